"""Long contexts on a tiny llama with llama3 rope scaling: chunked prefill of thousands of tokens
equals transformers, a context past the model's positions needs the operator's override, and a
cache filled without its prefill is decoded from (engine.context_length, engine.filled_context)."""

from __future__ import annotations

import logging

import pytest
import torch

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.engine.filled_context import fill_prefix_cache
from tests.gpuworker.checkpoints import TINY
from tests.gpuworker.engine.reference import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def run(engine: LLMEngine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    return finished


def test_chunked_prefill_of_thousands_of_tokens_equals_transformers(tiny_checkpoint):
    path = tiny_checkpoint("llama3.1", max_position_embeddings=4096)
    # The long prompt takes six chunks while a short one is served beside it.
    long, short = random_prompts((3000, 20), TINY["vocab_size"], seed=3)
    engine = LLMEngine(path, num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=4)
    engine.add_request("long", long, GREEDY)
    engine.add_request("short", short, GREEDY)
    finished = run(engine)
    assert [finished["long"].token_ids, finished["short"].token_ids] == hf_greedy(path, [long, short], 4)


def test_a_context_past_the_models_positions_needs_the_override(tiny_checkpoint):
    path = tiny_checkpoint("llama3.1", max_position_embeddings=512)
    with pytest.raises(
        ValueError, match=r"max_model_len \(1536\) exceeds the model's context \(512.*allow_long_context"
    ):
        LLMEngine(path, max_model_len=1536, num_kv_blocks=128)


def test_with_the_override_positions_past_the_model_match_transformers(tiny_checkpoint, caplog):
    # transformers computes the rotation at any position; the engine's table must reach them too.
    path = tiny_checkpoint("llama3.1", max_position_embeddings=512)
    with caplog.at_level(logging.WARNING, logger="gpuworker.engine.context_length"):
        engine = LLMEngine(
            path, max_model_len=1536, allow_long_context=True, num_kv_blocks=128, max_num_batched_tokens=256
        )
    assert "exceeds the model's context of 512 positions" in caplog.text
    assert engine.config.max_model_len == 1536
    (prompt,) = random_prompts((1100,), TINY["vocab_size"], seed=4)
    engine.add_request("past", prompt, GREEDY)
    assert run(engine)["past"].token_ids == hf_greedy(path, [prompt], 4)[0]


def test_a_filled_cache_is_decoded_from_after_prefilling_only_the_last_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama3.1", max_position_embeddings=4096)
    engine = LLMEngine(path, num_kv_blocks=160, max_num_batched_tokens=512, max_num_seqs=4)
    (prompt,) = random_prompts((2005,), TINY["vocab_size"], seed=5)
    blocks = fill_prefix_cache(engine, prompt, seed=1)
    assert len(blocks) == 2000 // 16 == 125
    for layer in engine.runner.kv_caches:  # random rows written in every layer's K and V planes
        assert bool(layer[:, blocks].abs().sum(dim=(2, 3, 4)).gt(0).all())
        assert float(layer[:, blocks].std()) == pytest.approx(1.0, rel=0.1)
    engine.add_request("filled", prompt, GREEDY)
    engine.step()
    seq = engine.scheduler.running[0]
    # The sequence starts on the filled blocks and computes only the last 5 tokens.
    assert seq.block_table[:125] == blocks
    assert seq.num_cached_tokens == 2000
    assert seq.num_computed_tokens == 2005
    out = run(engine)["filled"]
    assert len(out.token_ids) == 4 and out.num_cached_tokens == 2000
    assert engine.scheduler.block_manager.num_free_blocks == 160


def test_filling_more_than_the_pool_holds_is_refused(tiny_checkpoint):
    path = tiny_checkpoint("llama3.1", max_position_embeddings=4096)
    engine = LLMEngine(path, num_kv_blocks=130, max_num_batched_tokens=512, max_num_seqs=4)
    (prompt,) = random_prompts((2100,), TINY["vocab_size"], seed=6)
    with pytest.raises(ValueError, match=r"2096 tokens need 131 KV blocks, the pool has 130 free"):
        fill_prefix_cache(engine, prompt)
    assert engine.scheduler.block_manager.num_free_blocks == 130
    assert torch.count_nonzero(engine.runner.kv_cache) == 0


def test_filling_needs_prefix_caching_and_an_idle_engine(tiny_checkpoint):
    path = tiny_checkpoint("llama3.1", max_position_embeddings=4096)
    (prompt,) = random_prompts((100,), TINY["vocab_size"], seed=7)
    uncached = LLMEngine(path, num_kv_blocks=64, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        fill_prefix_cache(uncached, prompt)
    busy = LLMEngine(path, num_kv_blocks=64)
    busy.add_request("a", prompt, GREEDY)
    with pytest.raises(ValueError, match="before submitting requests"):
        fill_prefix_cache(busy, prompt)


@pytest.mark.slow
def test_tensor_parallel_ranks_serve_past_the_models_positions_too(tiny_checkpoint):
    # Each rank builds its own model: its rotary table must reach max_model_len as rank 0's does.
    path = tiny_checkpoint("llama3.1", max_position_embeddings=512)
    (prompt,) = random_prompts((1100,), TINY["vocab_size"], seed=8)
    kwargs = dict(max_model_len=1536, allow_long_context=True, num_kv_blocks=128, max_num_batched_tokens=256)
    engine = LLMEngine(path, tensor_parallel_size=2, **kwargs)
    try:
        outputs = engine.generate([prompt], GREEDY)
    finally:
        engine.shutdown()
    assert outputs[0].outputs[0].token_ids == hf_greedy(path, [prompt], 4)[0]


def test_a_million_token_max_model_len_sends_tables_as_wide_as_the_sequences(tiny_checkpoint):
    # 65,536 blocks a row at block 16; short sequences' steps carry a few columns, outputs unchanged.
    path = tiny_checkpoint("llama3.1", max_position_embeddings=4096)
    engine = LLMEngine(
        path, max_model_len=1 << 20, allow_long_context=True, num_kv_blocks=1 << 16, max_num_batched_tokens=256
    )
    runner = engine.runner
    prepare, widths = runner.prepare_inputs, []

    def recording_prepare(batch, previous=None, host=None):
        inputs = prepare(batch, previous, host=host)
        widths.append(inputs.meta.block_tables.shape[1])
        return inputs

    runner.prepare_inputs = recording_prepare
    prompts = random_prompts((5, 40, 130), TINY["vocab_size"], seed=9)
    outputs = engine.generate(prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == hf_greedy(path, prompts, 4)
    assert runner.block_tables.array.shape[1] == 16  # not 65,536 columns a row on the host
    assert widths and max(widths) == 16  # 134 tokens: 9 blocks, padded to the narrowest width
