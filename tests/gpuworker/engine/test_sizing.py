"""Start-up sizes from made-up device memory: the batch limits chosen for the device and the model
when not given, the KV pool beside them, and given values always kept."""

from __future__ import annotations

import pytest

from gpuworker.engine.config import EngineConfig
from gpuworker.engine.sizing import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    MAX_NUM_SEQS,
    MIN_NUM_SEQS,
    TOKENS_PER_SEQ,
    block_table_row_bytes,
    default_max_num_batched_tokens,
    kv_cache_block_bytes,
    mla_prefill_bytes,
    plan_sizes,
    seq_activation_bytes,
    token_activation_bytes,
    vision_activation_bytes,
)
from gpuworker.models.config import ModelConfig

GIB = 1 << 30
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
# bf16, block size 16: 32 layers x K and V x 8 heads x 128 dims x 2 bytes per token.
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def model(**overrides) -> ModelConfig:
    return ModelConfig.from_hf({**LLAMA_3_8B, **overrides})


def plan(
    free_gib: float | None,
    *,
    mc: ModelConfig | None = None,
    max_model_len: int = 8192,
    kv_element_size: int | None = None,
    max_model_len_set: bool = False,
    **config,
):
    if max_model_len_set:
        config["max_model_len"] = max_model_len
    return plan_sizes(
        EngineConfig(model="unused", **config),
        mc or model(),
        element_size=2,
        max_model_len=max_model_len,
        kv_element_size=kv_element_size,
        free_device_bytes=None if free_gib is None else int(free_gib * GIB),
    )


def pool_tokens(config: EngineConfig) -> int:
    return config.num_kv_blocks * config.block_size


def test_an_h200_runs_1024_sequences_of_an_8b_model():
    # An H200 (~140 GiB) with Llama-3-8B's 15 GiB of bf16 weights loaded.
    sized = plan(125)
    assert sized.max_num_seqs == MAX_NUM_SEQS == 1024
    assert sized.max_num_batched_tokens == 8192
    # The pool holds every sequence at the expected length, with room to spare on this GPU.
    assert pool_tokens(sized) >= MAX_NUM_SEQS * TOKENS_PER_SEQ


@pytest.mark.parametrize("free_gib", [6, 20, 62])
def test_a_smaller_gpu_runs_as_many_sequences_as_its_pool_holds(free_gib):
    sized = plan(free_gib)
    assert MIN_NUM_SEQS < sized.max_num_seqs < MAX_NUM_SEQS
    # As many as fit at TOKENS_PER_SEQ each (one more would not; its share of the sampler's
    # temporaries is worth under 24 tokens of this model's KV).
    assert sized.max_num_seqs * TOKENS_PER_SEQ <= pool_tokens(sized) < (sized.max_num_seqs + 1) * TOKENS_PER_SEQ + 24


def test_more_memory_never_means_fewer_sequences_or_a_smaller_pool():
    sizes = [plan(free_gib) for free_gib in (4, 8, 16, 32, 64, 128)]
    assert [s.max_num_seqs for s in sizes] == sorted(s.max_num_seqs for s in sizes)
    assert [pool_tokens(s) for s in sizes] == sorted(pool_tokens(s) for s in sizes)


def test_a_nearly_full_gpu_still_gets_the_minimum_of_sequences():
    # 1.5 GiB: after the 1 GiB of activations for 8,192 tokens, a pool of under 3k tokens.
    sized = plan(1.5)
    assert sized.max_num_seqs == MIN_NUM_SEQS
    assert 0 < pool_tokens(sized) < MIN_NUM_SEQS * TOKENS_PER_SEQ


def test_no_room_for_one_block_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization \(0.9\) of \d+ free bytes leaves no room"):
        plan(1)


def test_a_given_pool_sets_the_sequences_from_its_size():
    sized = plan(125, num_kv_blocks=1000)  # 16,000 tokens
    assert sized.num_kv_blocks == 1000
    assert sized.max_num_seqs == 16000 // TOKENS_PER_SEQ
    # A short context holds fewer tokens per sequence, so more sequences fit.
    assert plan(125, num_kv_blocks=1000, max_model_len=256).max_num_seqs == 16000 // 256


def test_given_values_always_win():
    sized = plan(125, max_num_seqs=64, max_num_batched_tokens=4096)
    assert (sized.max_num_seqs, sized.max_num_batched_tokens) == (64, 4096)
    # The pool is sized with the given values: every sequence at full length, and no more.
    assert sized.num_kv_blocks == 64 * 8192 // 16
    assert plan(125, max_num_seqs=2048).max_num_seqs == 2048
    # The chosen token budget leaves room to decode every given sequence in one step.
    assert plan(125, max_num_seqs=12288).max_num_batched_tokens == 12288
    given_pool = plan(None, num_kv_blocks=12, max_num_seqs=3, max_num_batched_tokens=100)
    assert (given_pool.num_kv_blocks, given_pool.max_num_seqs, given_pool.max_num_batched_tokens) == (12, 3, 100)


def test_cpu_keeps_small_fixed_limits():
    sized = plan(None, kv_cache_memory_bytes=64 * 2 * 1024 * 1024)
    assert (sized.max_num_seqs, sized.max_num_batched_tokens) == (CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS)
    assert sized.num_kv_blocks == 64


def test_an_fp8_cache_holds_twice_the_blocks_in_the_same_memory():
    # One byte per cached key or value instead of bf16's two; the activations keep theirs.
    bf16, fp8 = plan(125), plan(125, kv_element_size=1)
    assert fp8.max_num_seqs == bf16.max_num_seqs == MAX_NUM_SEQS
    assert fp8.num_kv_blocks in (2 * bf16.num_kv_blocks, 2 * bf16.num_kv_blocks + 1)  # one floor apart
    assert plan(None, kv_cache_memory_bytes=64 * 2 * 1024 * 1024, kv_element_size=1).num_kv_blocks == 2 * 64


@pytest.mark.parametrize(
    "shape, tokens",
    [
        # Llama-3.2-1B and -3B: small models get the largest budget.
        ({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32}, 16384),
        ({"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24}, 16384),
        ({}, 8192),  # Llama-3-8B
        # Qwen3-8B-like: a little more than Llama-3-8B in its layers keeps the same budget.
        ({"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 37}, 8192),
        # Qwen2.5-14B-like: 48 layers of 5120.
        ({"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40}, 4096),
        # Llama-3-70B: the smallest budget.
        ({"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64}, 2048),
    ],
)
def test_token_budget_shrinks_as_the_model_grows(shape, tokens):
    assert default_max_num_batched_tokens(model(**shape)) == tokens
    assert plan(125, mc=model(**shape), max_num_seqs=8).max_num_batched_tokens == tokens


QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "image_token_id": 151655,
    "vision_start_token_id": 151652,
    "text_config": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 128000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "num_heads": 16,
        "intermediate_size": 3420,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}
# Qwen2.5-VL-7B in bf16 with a step of 8,192 tokens: one encoder call of 65,536 patch rows, each
# (8 x 1280 + 3 x 3420) x 2 bytes of block activations and 3 x 2 x 14 x 14 = 1,176 pixel values at
# 4 + 2 bytes (float32, then cast); and 16,384 cached image tokens of 3,584 x 2 bytes.
VISION_BYTES_7B = 65536 * ((8 * 1280 + 3 * 3420) * 2 + 1176 * 6) + 16384 * 3584 * 2


def test_a_vision_models_pool_leaves_room_for_its_encoder_and_image_cache():
    import dataclasses

    vision = ModelConfig.from_hf(QWEN2_5_VL_7B)
    text_only = dataclasses.replace(vision, vision=None)  # the same decoder without the tower
    assert vision_activation_bytes(vision, 2, 8192) == VISION_BYTES_7B  # about 2.8 GiB
    assert vision_activation_bytes(text_only, 2, 8192) == 0
    block_bytes = 28 * 2 * 16 * 4 * 128 * 2  # 28 layers x K and V x 16 tokens x 4 heads x 128 dims x bf16
    # The same sequences: the pool is smaller by the vision bytes, to the block.
    settings = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "max_model_len": 128000}
    with_tower, without = plan(80, mc=vision, **settings), plan(80, mc=text_only, **settings)
    assert without.num_kv_blocks - with_tower.num_kv_blocks in (
        VISION_BYTES_7B // block_bytes,
        -(-VISION_BYTES_7B // block_bytes),
    )
    # Sequences chosen from the room: fewer fit beside the tower, in a smaller pool.
    settings["max_num_seqs"] = None
    with_tower, without = plan(24, mc=vision, **settings), plan(24, mc=text_only, **settings)
    assert MIN_NUM_SEQS < with_tower.max_num_seqs < without.max_num_seqs < MAX_NUM_SEQS
    assert with_tower.num_kv_blocks < without.num_kv_blocks


def test_a_vision_model_on_a_gpu_too_small_for_its_encoder_is_refused():
    vision = ModelConfig.from_hf(QWEN2_5_VL_7B)
    with pytest.raises(ValueError, match="leaves no room for one KV block"):
        plan(VISION_BYTES_7B / GIB, mc=vision, max_num_batched_tokens=8192, max_num_seqs=8)


MILLION = 1 << 20


def test_a_million_token_fp8_sequence_fits_an_h200_beside_an_8b_model():
    sized = plan(125, max_model_len=MILLION, kv_element_size=1, max_model_len_set=True)
    assert pool_tokens(sized) >= MILLION
    # The FP8 pool's bytes are what the memory holds, not the bf16 figure.
    assert sized.num_kv_blocks * sized.block_size * KV_BYTES_PER_TOKEN // 2 < 125 * 0.9 * GIB


def test_a_million_token_bf16_sequence_is_refused_with_the_bytes_it_needs():
    # 128 KiB a token in bf16: 128 GiB for one 1M-token sequence, more than the GPU has left.
    with pytest.raises(ValueError, match=r"max_model_len \(1048576\) needs 128\.0 GiB.*kv_cache_dtype 'fp8'"):
        plan(125, max_model_len=MILLION, max_model_len_set=True)


def test_a_default_context_larger_than_the_pool_is_not_refused_here():
    # max_model_len left None: the engine lowers it to the pool instead (llm_engine._size).
    sized = plan(40, max_model_len=MILLION)
    assert pool_tokens(sized) < MILLION


def test_each_sequence_slot_pays_for_its_block_table_row():
    # 65,536 int32 block ids a sequence at 1M tokens: the decode graphs' table row per slot.
    assert block_table_row_bytes(MILLION, 16) == 65536 * 4
    short = plan(125, max_model_len=8192, kv_element_size=1, max_num_seqs=1024)
    long = plan(125, max_model_len=MILLION, kv_element_size=1, max_num_seqs=1024, max_model_len_set=True)
    rows = 1024 * (block_table_row_bytes(MILLION, 16) - block_table_row_bytes(8192, 16))
    fp8_block_bytes = 16 * KV_BYTES_PER_TOKEN // 2
    assert abs((short.num_kv_blocks - long.num_kv_blocks) - rows / fp8_block_bytes) <= 1


def test_a_latent_attention_pool_leaves_room_for_its_largest_prefill_group():
    """DeepSeek-V2-Lite in bf16: what the budget holds beyond the pool, the activations and the
    sequence slots is the largest group of expanded keys and values a prefill step can hold (one
    sequence at its full 163,840-token context: 163,840 rows of an int64 slot, the 576-value latent
    row and 16 heads x 256 expanded values), to within a block."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "configs" / "deepseek-v2-lite" / "config.json"
    mc = ModelConfig.from_hf(json.loads(path.read_text()))
    tokens, seqs, context = 8192, 256, 163840
    reserved = mla_prefill_bytes(
        mc, element_size=2, kv_element_size=2, max_model_len=context, max_num_seqs=seqs, max_num_batched_tokens=tokens
    )
    assert reserved == context * (8 + (576 + 16 * 256) * 2) + (seqs + 1) * 12  # about 1.4 GiB
    sized = plan(60, mc=mc, max_model_len=context, max_num_batched_tokens=tokens, max_num_seqs=seqs)
    block_bytes = kv_cache_block_bytes(mc, sized.block_size, 2)
    taken = (
        tokens * token_activation_bytes(mc, 2)
        + seqs * (seq_activation_bytes(mc) + block_table_row_bytes(context, sized.block_size))
        + sized.num_kv_blocks * block_bytes
    )
    left = int(60 * GIB * sized.gpu_memory_utilization) - taken
    assert reserved <= left < reserved + block_bytes
