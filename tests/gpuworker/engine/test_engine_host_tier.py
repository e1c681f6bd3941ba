"""The host KV tier changes no token: multi-turn conversations sharing prefixes, interleaved so the
small GPU pool evicts each conversation's history between its turns, give the same greedy outputs
with the tier on and off; with it on, their histories come back from host memory (counters). Covered
for a dense model (keys and values), an FP8 cache, and a latent-attention model (one latent plane)."""

from __future__ import annotations

import random

import pytest

from gpuworker.engine import LLMEngine, SamplingParams
from tests.gpuworker.models.deepseek_checkpoints import MLA_TINY, make_mla_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
NUM_CONVERSATIONS = 3
NUM_TURNS = 3
SYSTEM_TOKENS = 40  # every conversation starts with the same system prompt


def engine(path, host_bytes: int, **overrides) -> LLMEngine:
    # 12 blocks of 16 tokens: one conversation's history (up to ~150 tokens) fits, not all three.
    kwargs = dict(num_kv_blocks=12, max_model_len=192, max_num_seqs=2, max_num_batched_tokens=64)
    kwargs.update(overrides)
    return LLMEngine(path, device="cpu", dtype="float32", host_kv_cache_bytes=host_bytes, **kwargs)


def run_conversations(llm: LLMEngine, vocab_size: int) -> list[list[int]]:
    """Each turn of each conversation in turn: its history, the reply, then new user tokens."""
    rng = random.Random(7)
    system = [rng.randrange(vocab_size) for _ in range(SYSTEM_TOKENS)]
    histories = [list(system) for _ in range(NUM_CONVERSATIONS)]
    replies = []
    for _ in range(NUM_TURNS):
        for history in histories:
            history += [rng.randrange(vocab_size) for _ in range(rng.randrange(20, 40))]
            [out] = llm.generate([list(history)], GREEDY)
            history += out.outputs[0].token_ids
            replies.append(out.outputs[0].token_ids)
    return replies


def host_bytes_for(llm_off: LLMEngine, blocks: int) -> int:
    cache = llm_off.runner.kv_cache
    return blocks * cache[:, :, 0].numel() * cache.element_size()


@pytest.fixture(scope="module")
def mla_path(tmp_path_factory):
    return make_mla_checkpoint(tmp_path_factory.mktemp("mla"), "deepseek-v2")


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("llama", {"kv_cache_dtype": "fp8"}), ("llama", {"async_scheduling": True}), ("mla", {})],
    ids=["dense", "fp8", "async", "mla"],
)
def test_outputs_unchanged_by_the_host_tier(family, overrides, tiny_checkpoint, mla_path):
    path = mla_path if family == "mla" else tiny_checkpoint("llama")
    off = engine(path, 0, **overrides)
    vocab_size = MLA_TINY["vocab_size"] if family == "mla" else off.model_config.vocab_size
    expected = run_conversations(off, vocab_size)
    on = engine(path, host_bytes_for(off, 64), **overrides)
    assert run_conversations(on, vocab_size) == expected
    figures_on, figures_off = on.serving_figures(), off.serving_figures()
    assert figures_off["host_cache_hits"] == 0
    assert figures_on["host_cache_hits"] > 0
    # The restored blocks are served as prefix-cache hits: fewer prompt tokens recomputed.
    assert figures_on["prefix_cache_hits"] > figures_off["prefix_cache_hits"]
    tier = on.scheduler.block_manager.host_tier
    assert tier.num_spilled > 0 and tier.num_restored > 0
    assert not on.runner.host_kv.has_in_flight


def test_a_tier_smaller_than_the_working_set_evicts_lru_and_stays_exact(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    off = engine(path, 0)
    expected = run_conversations(off, off.model_config.vocab_size)
    on = engine(path, host_bytes_for(off, 6))
    assert run_conversations(on, on.model_config.vocab_size) == expected
    tier = on.scheduler.block_manager.host_tier
    assert tier.num_slots == 6 and tier.num_evicted > 0


def test_refused_settings(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="host_kv_cache_bytes must be a non-negative integer"):
        engine(path, -1)
    with pytest.raises(ValueError, match="host_kv_cache_bytes needs enable_prefix_caching"):
        engine(path, 1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"host_kv_cache_bytes \(10\) cannot hold one KV block"):
        engine(path, 10)


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["gpu-only", "host-tier"])
def test_held_block_hashes_follow_the_prompt_through_both_tiers(host_blocks, tiny_checkpoint):
    from gpuworker.engine.block_manager import last_block_hash

    path = tiny_checkpoint("llama")
    llm = engine(path, 0)
    if host_blocks:
        llm = engine(path, host_bytes_for(llm, host_blocks))
    prompt = list(range(1, 101))
    llm.generate([prompt], GREEDY)
    block_hash = last_block_hash(prompt, llm.config.block_size)
    assert llm.held_block_hashes([block_hash, 12345]) == [block_hash]
    for i in range(3):  # fill the 12-block pool with other prompts: the first one is evicted
        llm.generate([[200 + i] * 150], GREEDY)
    assert llm.held_block_hashes([block_hash]) == ([block_hash] if host_blocks else [])
    assert last_block_hash(prompt[:16], 16) is None  # its last token is never cached: no full block
