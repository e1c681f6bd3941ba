"""Tiny random DeepSeek-V2/V3 checkpoints, built with transformers as tests.gpuworker.checkpoints
builds the other families': all layers dense (first_k_dense_replace = num_hidden_layers), or layer 0
dense and layer 1 a mixture of experts routed as each version routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuworker.demo_model import BOS_TOKEN_ID, EOS_TOKEN_IDS, write_tokenizer
from tests.gpuworker.checkpoints import _redraw_weights

MLA_TINY = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    # transformers builds the dense MLP for layers below first_k_dense_replace.
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_IDS[1],
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}
# name -> (config class, overrides of MLA_TINY)
MLA_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek-v2": ("DeepseekV2Config", {"q_lora_rank": None}),
    "deepseek-v2-qlora-yarn": ("DeepseekV2Config", {"q_lora_rank": 48, "rope_parameters": YARN}),
    "deepseek-v3": ("DeepseekV3Config", {"q_lora_rank": 48}),
    "deepseek-v3-yarn": ("DeepseekV3Config", {"q_lora_rank": None, "rope_parameters": YARN}),
    "deepseek-v3-rotate-half": ("DeepseekV3Config", {"q_lora_rank": 48, "rope_interleave": False}),
    # Softmax greedy routing over 8 experts, two shared experts.
    "deepseek-v2-moe": (
        "DeepseekV2Config",
        {
            "q_lora_rank": None,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 2,
            "topk_method": "greedy",
        },
    ),
    # Sigmoid noaux_tc routing with its correction bias, 2 of 4 groups, routed scaling; YaRN.
    "deepseek-v3-moe": (
        "DeepseekV3Config",
        {
            "q_lora_rank": 48,
            "first_k_dense_replace": 1,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "rope_parameters": YARN,
        },
    ),
}


def make_mla_checkpoint(tmp_path: str | Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    import torch
    import transformers

    config_class_name, family_overrides = MLA_FAMILIES[family]
    config = getattr(transformers, config_class_name)(**{**MLA_TINY, **family_overrides, **overrides})
    config.architectures = [config_class_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw_weights(model, seed)
    directory = Path(tmp_path) / family
    model.save_pretrained(str(directory))
    write_tokenizer(directory, config.vocab_size, config.max_position_embeddings)
    return directory
