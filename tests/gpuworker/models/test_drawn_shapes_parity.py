"""Shapes nobody wrote down: for DeepSeek-V2, DeepSeek-V3, GLM-4.5-MoE and Gemma 3, seeded random tiny
configs (heads, head dims, latent and query ranks, experts and their groups, dense first layers,
rope scaling, windows) whose greedy tokens through the engine equal transformers' on the same
random checkpoint, float32 on CPU. A draw that fails is a bug in the engine, not in the draw."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpuworker.engine import LLMEngine, SamplingParams
from tests.gpuworker.checkpoints import make_checkpoint
from tests.gpuworker.models.deepseek_checkpoints import make_mla_checkpoint

DRAWS_PER_FAMILY = 4
PROMPT_TOKENS = 14
MAX_TOKENS = 6


def _yarn(rng: random.Random) -> dict[str, Any]:
    return {
        "rope_type": "yarn",
        "rope_theta": rng.choice([10000.0, 50000.0]),
        "factor": rng.choice([2.0, 4.0, 40.0]),
        "original_max_position_embeddings": rng.choice([64, 256]),
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": rng.choice([0.707, 1.0]),
        "mscale_all_dim": rng.choice([0.707, 1.0]),
    }


def _experts(rng: random.Random) -> dict[str, Any]:
    """Experts in groups, the kept groups and the experts chosen among them."""
    n_group = rng.choice([1, 2, 4])
    experts = n_group * rng.choice([2, 3, 4])
    topk_group = rng.randint(1, n_group)
    return {
        "n_routed_experts": experts,
        "n_group": n_group,
        "topk_group": topk_group,
        "num_experts_per_tok": rng.randint(1, min(4, topk_group * experts // n_group)),
        "n_shared_experts": rng.choice([1, 2]),
        "moe_intermediate_size": rng.choice([16, 24, 32]),
        "routed_scaling_factor": rng.choice([1.0, 2.5]),
    }


def _deepseek(rng: random.Random, version: int) -> dict[str, Any]:
    layers = rng.randint(1, 3)
    heads = rng.choice([1, 2, 3, 4])
    config = {
        # transformers asks for a hidden size that the heads divide, though latent attention does not.
        "hidden_size": rng.choice([h for h in (32, 48, 64) if h % heads == 0]),
        "intermediate_size": rng.choice([48, 96]),
        "num_hidden_layers": layers,
        "first_k_dense_replace": rng.randint(0, layers),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": rng.choice([8, 16, 24, 40]),
        "q_lora_rank": rng.choice([None, 16, 40]),
        "qk_nope_head_dim": rng.choice([8, 16, 24]),
        "qk_rope_head_dim": rng.choice([4, 8, 16]),
        "v_head_dim": rng.choice([8, 16, 20, 32]),
        "rope_parameters": _yarn(rng) if rng.random() < 0.5 else {"rope_type": "default", "rope_theta": 10000.0},
        # Biases on q_a_proj, kv_a_proj_with_mqa and o_proj.
        "attention_bias": rng.choice([True, False]),
        "tie_word_embeddings": rng.random() < 0.25,
        **_experts(rng),
    }
    if version == 2:
        # transformers' V2 takes the group-limited choice only where it has groups.
        grouped = config["n_group"] > 1 and rng.random() < 0.5
        config["topk_method"] = "group_limited_greedy" if grouped else "greedy"
        if not grouped:
            config.update(n_group=None, topk_group=None)
    else:
        config["norm_topk_prob"] = rng.choice([True, False])
        config["rope_interleave"] = rng.choice([True, False])
    return config


def _glm4_moe(rng: random.Random) -> dict[str, Any]:
    layers = rng.randint(1, 3)
    heads = rng.choice([2, 4, 6])
    return {
        "hidden_size": rng.choice([32, 64]),
        "intermediate_size": rng.choice([48, 96]),
        "num_hidden_layers": layers,
        "first_k_dense_replace": rng.randint(0, layers),
        "num_attention_heads": heads,
        "num_key_value_heads": rng.choice([k for k in (1, 2, heads) if heads % k == 0]),
        "head_dim": rng.choice([16, 32]),
        "attention_bias": rng.choice([True, False]),
        "use_qk_norm": rng.choice([True, False]),
        "norm_topk_prob": rng.choice([True, False]),
        **_experts(rng),
    }


def _gemma3(rng: random.Random) -> dict[str, Any]:
    layers = rng.randint(1, 4)
    heads = rng.choice([2, 4])
    return {
        "hidden_size": rng.choice([32, 64]),
        "intermediate_size": rng.choice([48, 96]),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": rng.choice([1, heads]),
        "head_dim": rng.choice([16, 32]),
        "layer_types": [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)],
        "sliding_window": rng.choice([4, 9, 16]),
        "query_pre_attn_scalar": rng.choice([16, 24, 32]),
        "final_logit_softcapping": rng.choice([None, 30.0]),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": rng.choice(
                [
                    {"rope_type": "default", "rope_theta": 1000000.0},
                    {"rope_type": "linear", "rope_theta": 1000000.0, "factor": rng.choice([2.0, 8.0])},
                ]
            ),
        },
    }


# family -> (draw, build a checkpoint of a draw)
FAMILIES = {
    "deepseek-v2": (lambda rng: _deepseek(rng, 2), lambda path, c: make_mla_checkpoint(path, "deepseek-v2", **c)),
    "deepseek-v3": (lambda rng: _deepseek(rng, 3), lambda path, c: make_mla_checkpoint(path, "deepseek-v3", **c)),
    "glm4-moe": (_glm4_moe, lambda path, c: make_checkpoint(path, "glm4-moe", **c)),
    "gemma3": (_gemma3, lambda path, c: make_checkpoint(path, "gemma3", **c)),
}
CASES = [(family, draw) for family in FAMILIES for draw in range(DRAWS_PER_FAMILY)]


def drawn_config(family: str, draw: int) -> dict[str, Any]:
    rng = random.Random(f"{family}-{draw}")
    return FAMILIES[family][0](rng)


@pytest.mark.parametrize(("family", "draw"), CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_greedy_equals_transformers_on_a_drawn_shape(family, draw, tmp_path):
    config = drawn_config(family, draw)
    path = FAMILIES[family][1](tmp_path, config)
    prompt = torch.randint(0, 384, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(draw)).tolist()
    ids = torch.tensor([prompt])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None
        )
    # Blocks of 8 tokens: a window and the prompt span several, so chunked prefills and decodes read
    # the paged cache across block edges.
    engine = LLMEngine(path, device="cpu", dtype="float32", max_model_len=64, block_size=8, max_num_batched_tokens=8)
    [output] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert output.outputs[0].token_ids == out[0, ids.shape[1] :].tolist(), config
