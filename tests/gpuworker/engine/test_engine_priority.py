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


def test_batch_prefill_is_capped_beside_an_interactive_stream_and_every_output_matches_running_alone(path):
    """Beside a decoding interactive request, two long batch prompts prefill 16 tokens a step (a
    quarter of the 64-token budget) instead of the whole step; with the cap off
    (batch_prefill_share=1) they take what the chat's decode leaves. Either way every request gets
    the tokens it gets alone."""
    chat_prompt, *batch_prompts = random_prompts((20, 120, 120), TINY["vocab_size"], seed=3)

    def run_with(batch_prefill_share: float) -> tuple[int, dict[str, list[int]]]:
        engine = LLMEngine(
            path,
            num_kv_blocks=64,
            max_model_len=256,
            max_num_batched_tokens=64,
            batch_prefill_share=batch_prefill_share,
        )
        engine.add_request("chat", chat_prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        engine.step()
        for i, prompt in enumerate(batch_prompts):
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, priority="batch")
            engine.add_request(f"batch{i}", prompt, params)
        steps, first_token_step, tokens = 0, None, {}
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            for out in outputs:
                if out.request_id == "batch0" and first_token_step is None:
                    first_token_step = steps
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return first_token_step, tokens

    capped_steps, capped = run_with(0.25)
    uncapped_steps, uncapped = run_with(1.0)
    assert capped_steps >= 120 // 16 and uncapped_steps <= 2
    assert capped == uncapped
    assert capped["chat"] == alone(path, chat_prompt, 24)
    for i, prompt in enumerate(batch_prompts):
        assert capped[f"batch{i}"] == alone(path, prompt, 8)
