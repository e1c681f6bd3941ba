"""Tiny random Hugging Face checkpoints for tests, one per supported model family.

    from tests.gpuworker.checkpoints import make_checkpoint, FAMILIES
    path = make_checkpoint(tmp_path, "qwen3", num_hidden_layers=3)

Each is built with transformers itself (config class + AutoModelForCausalLM.from_config, fixed
seed, save_pretrained to safetensors) plus the demo model's byte-level tokenizer, so tests compare
the engine with transformers on exactly the files a user would have. Weights are redrawn so that
norms and biases are not their trivial init values (a mis-mapped norm or bias then shows up) and
logits are spread enough that greedy decoding is not decided by rounding noise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gpuworker.demo_model import BOS_TOKEN_ID, EOS_TOKEN_IDS, write_tokenizer

TINY = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_IDS[1],
}

# family -> (config class name in transformers, overrides of TINY)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama-mha": ("LlamaConfig", {"num_key_value_heads": 4}),
    "llama3.1": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # small, so that the tiny head_dim has high, blended and scaled bands
                "original_max_position_embeddings": 256,
            },
            "eos_token_id": EOS_TOKEN_IDS,
        },
    ),
    "mistral": (
        "MistralConfig",
        {"sliding_window": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    # head_dim 32 != hidden_size / heads, as in real Qwen3 models.
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3-bias": ("Qwen3Config", {"head_dim": 32, "attention_bias": True}),
    # Mixture of experts: 4 experts, 2 per token (renormalised); Qwen2-MoE with its shared expert,
    # no renormalisation and layer 0 dense; Qwen3-MoE with q/k norms and renormalisation.
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
        },
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "head_dim": 32,
        },
    ),
    # GLM-4.5: partial rotary (half of head_dim 32), q/k/v biases, a sigmoid router whose correction
    # bias (redrawn: it is not a parameter) moves the choice, one shared expert, layer 0 dense.
    "glm4-moe": (
        "Glm4MoeConfig",
        {
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "head_dim": 32,
            "attention_bias": True,
            "first_k_dense_replace": 1,
        },
    ),
    # With QK-norm, two of four groups kept, unnormalised weights scaled by 2.5, two shared experts
    # and two dense layers.
    "glm4-moe-grouped": (
        "Glm4MoeConfig",
        {
            "n_routed_experts": 16,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "n_shared_experts": 2,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 2.5,
            "use_qk_norm": True,
            "head_dim": 32,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 2,
        },
    ),
    # Gemma 3's text decoder: sliding layers with a window shorter than the tests' sequences (and
    # not a multiple of the 16-token block), full layers with linear rope scaling, an attention
    # scale of its own and logit softcapping that changes the logits.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "sliding_window": 21,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
            },
        },
    ),
    # The layout older checkpoints write: sliding_window_pattern, no softcapping, a window of one block.
    "gemma3-pattern": (
        "Gemma3TextConfig",
        {"head_dim": 16, "num_hidden_layers": 4, "sliding_window_pattern": 2, "sliding_window": 16},
    ),
}
# The architecture a config class's checkpoints name, where it is not the class name with
# Config replaced by ForCausalLM.
_ARCHITECTURES = {"Gemma3TextConfig": "Gemma3ForCausalLM"}


def make_checkpoint(
    tmp_path: str | Path,
    family: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny random `family` checkpoint into tmp_path/family and return that directory.

    `overrides` are config fields (e.g. num_hidden_layers=3, vocab_size=512); `dtype` is the stored
    weight dtype ("float32" or "bfloat16").
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    config_class_name, family_overrides = FAMILIES[family]
    kwargs = {**TINY, **family_overrides, **overrides}
    config = getattr(transformers, config_class_name)(**kwargs)
    config.architectures = [_ARCHITECTURES.get(config_class_name, config_class_name.replace("Config", "ForCausalLM"))]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw_weights(model, seed)
    model = model.to(getattr(torch, dtype))
    directory = Path(tmp_path) / family
    model.save_pretrained(str(directory))
    if tokenizer:
        write_tokenizer(directory, config.vocab_size, config.max_position_embeddings)
    return directory


def _redraw_weights(model: Any, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * torch.randn(param.shape, generator=generator)
            elif name.endswith(".bias"):
                value = 0.2 * torch.randn(param.shape, generator=generator)
            elif "embed_tokens" in name or "lm_head" in name:
                # Logits of a few units: greedy picks are clear, not ties broken by rounding.
                value = 0.5 * torch.randn(param.shape, generator=generator)
            else:
                value = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1])
            param.copy_(value)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
