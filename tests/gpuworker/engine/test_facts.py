"""EngineFacts: what a server reads of an engine, the same from the engine itself, from the engine
stepping in a thread and from the engine in a process of its own."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from operator import attrgetter

from gpuworker.engine import AsyncLLMEngine, LLMEngine, start_engine
from gpuworker.engine.engine_process_client import ProcessLLMEngine

CONFIG = {"num_kv_blocks": 64, "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 128}


def test_the_facts_are_the_resolved_config_and_the_model(tiny_checkpoint):
    engine = LLMEngine(tiny_checkpoint("llama"), **CONFIG)
    facts = engine.facts
    assert facts.limits == {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "max_model_len": 256,
        "kv_cache_tokens": 64 * engine.config.block_size,
        "host_kv_cache_tokens": 0,
        "tensor_parallel_size": 1,
    }
    assert facts.max_model_len == 256 and facts.vocab_size == engine.model_config.vocab_size
    # A copy: the deferred warm-up's later stages do not change facts already read.
    assert facts.load_timings == engine.load_timings and facts.load_timings is not engine.load_timings


async def test_start_engine_builds_the_thread_or_the_process_engine_with_the_same_facts(tiny_checkpoint):
    threaded = start_engine(tiny_checkpoint("llama"), **CONFIG)
    try:
        assert type(threaded) is AsyncLLMEngine
        expected = threaded.engine.facts
        assert replace(threaded.facts, load_timings={}) == replace(expected, load_timings={})
        assert threaded.prompts is threaded.engine.prompts
    finally:
        await asyncio.to_thread(threaded.shutdown)
    in_process = await asyncio.to_thread(start_engine, tiny_checkpoint("llama"), process=True, **CONFIG)
    try:
        assert type(in_process) is ProcessLLMEngine
        assert replace(in_process.facts, load_timings={}) == replace(expected, load_timings={})
        # The timings as the engine process had them when it became ready.
        there = await in_process.call(attrgetter("facts"))
        assert in_process.facts.load_timings.items() <= there.load_timings.items()
        assert {"weights", "kv_cache"} <= set(in_process.facts.load_timings)
        assert in_process.prompts.tokenize([1, 2, 3]).token_ids == [1, 2, 3]
        assert in_process.failure() is None
    finally:
        await asyncio.to_thread(in_process.shutdown)
