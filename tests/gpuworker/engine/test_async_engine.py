"""The streaming engines (start_engine): concurrent streams, aborts (explicit and by cancelling the
consumer), errors; each with the engine in a thread of the test's process (AsyncLLMEngine) and in a
process of its own (ProcessLLMEngine)."""

from __future__ import annotations

import asyncio
from operator import attrgetter, methodcaller

import pytest

from gpuworker.engine import SamplingParams, start_engine
from gpuworker.engine.output_streams import StreamingEngine
from tests.gpuworker.checkpoints import TINY
from tests.gpuworker.engine.reference import hf_greedy, random_prompts


@pytest.fixture(params=["thread", "process"])
async def engine(request, tiny_checkpoint):
    engine = start_engine(
        tiny_checkpoint("llama"), num_kv_blocks=64, max_model_len=256, process=request.param == "process"
    )
    yield engine
    await asyncio.to_thread(engine.shutdown)


async def kv_usage(engine: StreamingEngine) -> float:
    return await engine.call(attrgetter("scheduler.block_manager.usage"))


async def test_two_concurrent_streams(engine, tiny_checkpoint):
    prompts = random_prompts((7, 60), TINY["vocab_size"], seed=1)
    events: list[tuple[str, bool]] = []

    async def consume(request_id: str, prompt: list[int], max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = []
        async for out in engine.generate(prompt, params, request_id):
            events.append((request_id, out.finished))
            outputs.append(out)
        return outputs

    a, b = await asyncio.gather(consume("a", prompts[0], 8), consume("b", prompts[1], 12))
    reference = hf_greedy(tiny_checkpoint("llama"), prompts, 12)
    for outputs, expected in ((a, reference[0][:8]), (b, reference[1])):
        final = outputs[-1]
        assert final.finished and not any(out.finished for out in outputs[:-1])
        assert final.token_ids == expected
        assert [t for out in outputs for t in out.outputs[0].delta_token_ids] == expected
        assert "".join(out.outputs[0].delta_text for out in outputs) == final.text
    # Incremental and interleaved: b streamed tokens before a finished.
    assert len(a) > 1 and len(b) > 1
    assert events.index(("b", False)) < events.index(("a", True))


async def test_a_consumer_that_falls_behind_gets_one_output_for_the_steps_it_missed(engine, tiny_checkpoint):
    prompt = random_prompts((9,), TINY["vocab_size"], seed=2)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    stream = engine.generate(prompt, params, "slow")
    first = await stream.__anext__()
    # The consumer looks away until the engine has run the request to its end.
    while await engine.call(methodcaller("has_unfinished_requests")):
        await asyncio.sleep(0.01)
    rest = [out async for out in stream]
    assert len(rest) == 1 and rest[0].finished  # 15 steps' outputs, merged into one
    expected = hf_greedy(tiny_checkpoint("llama"), [prompt], 16)[0]
    assert rest[0].token_ids == expected
    assert first.outputs[0].delta_token_ids + rest[0].outputs[0].delta_token_ids == expected
    assert first.outputs[0].delta_text + rest[0].outputs[0].delta_text == rest[0].text


async def test_abort_frees_the_blocks_at_once(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    stream = engine.generate([1] * 50, params, "long")
    first = await stream.__anext__()
    assert not first.finished and await kv_usage(engine) > 0
    await engine.abort("long")
    assert await kv_usage(engine) == 0.0
    # Outputs of steps before the abort may still be queued; the stream ends with the abort.
    rest = [out async for out in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert len(rest[-1].token_ids) < 200


async def test_cancelling_the_consumer_aborts_the_request(engine):
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate([3] * 30, SamplingParams(max_tokens=200, ignore_eos=True), "c"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if not await engine.call(methodcaller("has_unfinished_requests")):
            break
        await asyncio.sleep(0.01)
    assert not await engine.call(methodcaller("has_unfinished_requests"))
    assert await kv_usage(engine) == 0.0


async def test_bad_request_raises_to_its_caller_only(engine):
    good = engine.generate([5] * 10, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), "good")
    first = await good.__anext__()
    with pytest.raises(ValueError, match="max_tokens"):
        async for _ in engine.generate([5] * 250, SamplingParams(max_tokens=50), "bad"):
            pass
    with pytest.raises(ValueError, match="already in use"):
        async for _ in engine.generate([5], SamplingParams(max_tokens=1), "good"):
            pass
    outputs = [first] + [out async for out in good]
    assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 200


async def test_shutdown_aborts_and_refuses_new_work(engine):
    stream = engine.generate([1] * 10, SamplingParams(max_tokens=100, ignore_eos=True), "x")
    await stream.__anext__()
    await asyncio.to_thread(engine.shutdown)
    assert [out async for out in stream][-1].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        await engine.abort("x")
