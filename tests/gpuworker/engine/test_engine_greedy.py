"""Greedy decoding equals transformers' greedy generate token for token, for every family.

Each family's tiny random checkpoint runs a batch mixing prompt lengths from 1 to 250 tokens: all
at once, with requests arriving between steps, with a KV pool small enough to force preemption,
with chunked prefill forced, and a second pass served partly from the prefix cache. Each runs
with synchronous steps and with async scheduling (step N+1 launched before step N's tokens are
read back, its inputs taken from step N's sampled ids on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuworker.engine import LLMEngine, SamplingParams
from tests.gpuworker.checkpoints import FAMILIES, TINY
from tests.gpuworker.engine.reference import hf_greedy, random_prompts

# Several prompts end just before a block boundary, so their decodes need new blocks.
LENGTHS = (1, 15, 16, 31, 47, 100, 250)
MAX_TOKENS = 10
MAX_MODEL_LEN = 272  # the longest prompt + MAX_TOKENS, rounded up to whole blocks (17)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Case:
    path: Path
    prompts: list[list[int]]
    reference: list[list[int]]

    async_scheduling: bool = False

    def engine(self, **overrides) -> LLMEngine:
        kwargs = dict(num_kv_blocks=96, max_model_len=MAX_MODEL_LEN, async_scheduling=self.async_scheduling)
        kwargs.update(overrides)
        return LLMEngine(self.path, device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tiny_checkpoint) -> Case:
    path = tiny_checkpoint(request.param)
    prompts = random_prompts(LENGTHS, TINY["vocab_size"], seed=len(request.param))
    return Case(path, prompts, hf_greedy(path, prompts, MAX_TOKENS))


@pytest.fixture(params=["sync", "async"])
def case(request, family_case) -> Case:
    return Case(family_case.path, family_case.prompts, family_case.reference, async_scheduling=request.param == "async")


def test_batch_all_at_once(case):
    outputs = case.engine().generate(case.prompts, GREEDY)
    assert [out.token_ids for out in outputs] == case.reference
    assert all(out.finish_reason == "length" and out.finished for out in outputs)


def test_requests_arriving_mid_run(case):
    engine = case.engine()
    results: dict[str, list[int]] = {}
    pending = list(enumerate(case.prompts))
    # Two requests first, then one more after every other step, while the others decode.
    for i, prompt in pending[:2]:
        engine.add_request(str(i), prompt, GREEDY)
    pending = pending[2:]
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if pending and steps % 2 == 1:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        steps += 1
    assert [results[str(i)] for i in range(len(case.prompts))] == case.reference


@pytest.mark.slow
def test_small_kv_pool_preempts_and_recomputes(case):
    # 17 blocks of 16 tokens hold one full-length sequence but not the whole batch: the shorter
    # prompts are admitted together (15 blocks) and then need 4 more blocks to decode.
    engine = case.engine(num_kv_blocks=17)
    outputs = engine.generate(case.prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [out.token_ids for out in outputs] == case.reference


@pytest.mark.slow
def test_chunked_prefill(case):
    engine = case.engine(max_num_batched_tokens=24, max_num_seqs=4)
    outputs = engine.generate(case.prompts, GREEDY)
    assert [out.token_ids for out in outputs] == case.reference


@pytest.mark.slow
def test_second_pass_hits_the_prefix_cache(case):
    engine = case.engine()
    first = engine.generate(case.prompts, GREEDY)
    assert all(out.num_cached_tokens == 0 for out in first)
    second = engine.generate(case.prompts, GREEDY)
    assert [out.token_ids for out in second] == case.reference
    # Every full block but the one holding the last prompt token is served from the cache.
    assert [out.num_cached_tokens for out in second] == [(n - 1) // 16 * 16 for n in LENGTHS]
    assert engine.last_step_stats.prefix_cache_hits == sum(out.num_cached_tokens for out in second)
