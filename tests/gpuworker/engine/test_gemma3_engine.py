"""Gemma 3 through the engine: greedy output equals transformers' across the sliding window (prompt
and output several windows long), with chunked prefill and prefix caching on; the sliding layers'
pool keeps each sequence's window only, and the memory it frees holds more tokens."""

from __future__ import annotations

import pytest

from gpuworker.engine import EngineConfig, LLMEngine, SamplingParams
from gpuworker.engine.sizing import plan_sizes
from gpuworker.models.config import ModelConfig
from tests.gpuworker.checkpoints import FAMILIES, TINY
from tests.gpuworker.engine.reference import hf_greedy, random_prompts

WINDOW = FAMILIES["gemma3"][1]["sliding_window"]
LENGTHS = (3, 30, 75, 160)  # up to several windows, crossing block and window edges
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    path = tiny_checkpoint("gemma3")
    prompts = random_prompts(LENGTHS, TINY["vocab_size"], seed=11)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def engine(path, **overrides) -> LLMEngine:
    # 24 tokens a step: long prompts run in chunks, mixed with the others' decodes.
    kwargs = dict(max_model_len=256, max_num_batched_tokens=24)
    kwargs.update(overrides)
    return LLMEngine(path, device="cpu", dtype="float32", **kwargs)


def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_cache(case):
    path, prompts, reference = case
    llm = engine(path)
    assert llm.config.window_pool is not None and llm.config.enable_prefix_caching
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == reference
    # Again: the prompts' blocks come from the prefix cache (full layers and windows).
    hits = llm.scheduler.block_manager.prefix_cache_hits
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == reference
    assert llm.scheduler.block_manager.prefix_cache_hits > hits
    pool = llm.scheduler.block_manager.window_pool
    assert pool.num_free_blocks == pool.num_blocks  # everything returned


def test_without_a_window_pool_the_output_is_the_same(case):
    path, prompts, reference = case
    llm = engine(path, num_window_kv_blocks=0)
    assert llm.config.window_pool is None and llm.runner.window_cache is None
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == reference


def test_a_long_sequence_holds_window_many_tokens_in_its_sliding_layers(case):
    path, prompts, reference = case
    llm = engine(path, async_scheduling=False)
    llm.add_request("long", prompts[-1], GREEDY)
    pool = llm.scheduler.block_manager.window_pool
    block_size = llm.config.block_size
    # A chunk of 24 behind the window at most, or the window and a decode's next block.
    bound = -(-(WINDOW - 1 + 24) // block_size) + 2
    most_held = 0
    outputs = []
    while llm.has_unfinished_requests():
        outputs += [out for out in llm.step() if out.finished]
        for seq in llm.scheduler.running:
            most_held = max(most_held, pool.blocks_held(seq))
            assert pool.blocks_held(seq) <= bound
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens  # full layers keep all
    assert outputs[0].token_ids == reference[-1]
    assert 0 < most_held <= bound < -(-(len(prompts[-1]) + MAX_TOKENS) // block_size)


def test_preemption_under_a_small_window_pool(case):
    path, prompts, reference = case
    # Room for little more than one sequence's window: the others wait or are preempted.
    llm = engine(path, num_window_kv_blocks=8, max_num_batched_tokens=16)
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == reference


def test_window_pool_smaller_than_one_sequence_is_refused(case):
    path, _, _ = case
    with pytest.raises(ValueError, match="num_window_kv_blocks"):
        engine(path, num_window_kv_blocks=2)


def gemma_config(num_layers: int = 6) -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "vocab_size": 262144,
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 131072,
            "sliding_window": 1024,
        }
    )


@pytest.mark.parametrize("free_device_bytes", [None, 40 << 30], ids=["cpu-budget", "gpu"])
def test_kv_capacity_grows_with_the_window_pool(free_device_bytes):
    mc = gemma_config(num_layers=34)  # Gemma 3 4B's layers: 5 sliding to 1 full
    base = EngineConfig(model="unused", kv_cache_memory_bytes=8 << 30, max_num_seqs=8, max_num_batched_tokens=2048)
    kwargs = dict(element_size=2, max_model_len=131072, free_device_bytes=free_device_bytes)
    pooled = plan_sizes(base, mc, **kwargs)
    flat = plan_sizes(EngineConfig(**{**base.__dict__, "num_window_kv_blocks": 0}), mc, **kwargs)
    assert pooled.window_pool == (1024, pooled.num_window_kv_blocks) and flat.window_pool is None
    tokens_pooled, tokens_flat = pooled.num_kv_blocks * 16, flat.num_kv_blocks * 16
    # 6 of 34 layers keep every token: nearly 34 / 6 times the tokens, less the windows set aside.
    assert tokens_pooled > 3.5 * tokens_flat
    # The window pool holds every sequence's window at once.
    assert pooled.num_window_kv_blocks * 16 >= 8 * 1024 + 2048


SHORT_LENGTHS = (3, 4, 5, 6, 7, 8, 8, 5)  # with their answers, each within one block


def test_short_sequences_take_a_block_of_window_not_a_whole_window(tiny_checkpoint):
    """Memory that holds every running sequence's whole window and nothing more: the window pool
    is split off as short sequences use it, so the full layers get the rest, the eight short
    sequences run at once holding one window block each, and the tokens are transformers'."""
    from gpuworker.engine.sizing import kv_cache_block_bytes, window_pool_blocks
    from gpuworker.models.loader import load_model_config

    path = tiny_checkpoint("gemma3")
    mc = load_model_config(path)
    answer = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(SHORT_LENGTHS, TINY["vocab_size"], seed=5)
    reference = hf_greedy(path, prompts, answer.max_tokens)
    sliding = sum(1 for window in mc.layer_windows if window is not None)
    whole_windows = window_pool_blocks(WINDOW, 16, len(prompts), 24) * kv_cache_block_bytes(mc, 16, 4, sliding)
    llm = engine(path, max_num_seqs=len(prompts), kv_cache_memory_bytes=whole_windows, async_scheduling=False)
    pool = llm.scheduler.block_manager.window_pool
    assert pool.num_blocks < window_pool_blocks(WINDOW, 16, len(prompts), 24) // 2
    for i, prompt in enumerate(prompts):
        llm.add_request(str(i), prompt, answer)
    outputs, most_running, most_held = {}, 0, 0
    while llm.has_unfinished_requests():
        outputs.update((out.request_id, out.token_ids) for out in llm.step() if out.finished)
        most_running = max(most_running, len(llm.scheduler.running))
        most_held = max(most_held, sum(pool.blocks_held(seq) for seq in llm.scheduler.running))
    assert [outputs[str(i)] for i in range(len(prompts))] == reference
    assert most_running == len(prompts) and most_held == len(prompts)  # N x ceil(len / block)


def test_the_memory_is_split_as_a_short_sequence_uses_it():
    """Gemma 3 12B's 40 sliding and 8 full layers, 256 sequences on 40 GiB: whole windows for all
    of them would not fit beside one block of the full layers; split as a sequence of 768 tokens
    uses the two pools (48 blocks of the full layers, 48 + 1 of window), both pools get room."""
    from gpuworker.engine.sizing import kv_cache_block_bytes, window_pool_blocks

    mc = gemma_config(num_layers=48)
    base = EngineConfig(model="unused", max_num_seqs=256, max_num_batched_tokens=2048)
    sized = plan_sizes(base, mc, element_size=2, max_model_len=131072, free_device_bytes=40 << 30)
    window_bytes = sized.num_window_kv_blocks * kv_cache_block_bytes(mc, 16, 2, 40)
    full_bytes = sized.num_kv_blocks * kv_cache_block_bytes(mc, 16, 2, 8)
    assert window_bytes / full_bytes == pytest.approx(49 * 40 / (48 * 8), rel=0.01)
    assert sized.num_window_kv_blocks < window_pool_blocks(1024, 16, 256, 2048)  # whole windows
