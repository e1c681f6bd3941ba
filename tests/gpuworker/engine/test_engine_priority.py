"""LLMEngine on a tiny llama: an interactive request that preempts a running batch request leaves
both outputs token for token those of running each alone (greedy), and the engine reports each
tenant's service."""

from __future__ import annotations

import pytest

from gpuworker.engine import LLMEngine, SamplingParams
from tests.gpuworker.checkpoints import TINY
from tests.gpuworker.engine.reference import random_prompts


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def alone(path, prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine(path, num_kv_blocks=64, max_model_len=256)
    engine.add_request("alone", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return _run(engine)["alone"].token_ids


def _run(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    return finished


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("short", ["seats", "blocks"])
def test_interactive_preempts_batch_and_both_outputs_match_running_alone(path, short, async_scheduling):
    batch_prompt, chat_prompt = random_prompts((50, 40), TINY["vocab_size"])
    # seats: one sequence at a time; blocks: a pool of 6 blocks of 16 tokens: the batch request holds 4
    # when the chat comes, whose 40-token prompt needs 3.
    limits = {"max_num_seqs": 1, "num_kv_blocks": 64} if short == "seats" else {"num_kv_blocks": 6}
    # Async scheduling (the CUDA default) preempts a sequence whose last token is still in flight.
    engine = LLMEngine(path, max_model_len=96, async_scheduling=async_scheduling, **limits)
    engine.add_request(
        "batch",
        batch_prompt,
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, tenant="acme", priority="batch"),
    )
    for _ in range(5):
        engine.step()
    engine.add_request("chat", chat_prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, tenant="b"))
    finished = _run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert finished["batch"].token_ids == alone(path, batch_prompt, 40)
    assert finished["chat"].token_ids == alone(path, chat_prompt, 8)
    figures = engine.serving_figures()
    served = {(tenant, priority): tokens for tenant, priority, tokens in figures["tenant_service"]}
    # Prompt tokens count once and output tokens twice, recomputation included.
    assert served.keys() == {("b", "interactive"), ("acme", "batch")}
    assert served["b", "interactive"] == 39 + 2 * 8
    assert served["acme", "batch"] >= 49 + 2 * 40
    assert figures["tenant_weights"] == {"acme": 1.0, "b": 1.0}
