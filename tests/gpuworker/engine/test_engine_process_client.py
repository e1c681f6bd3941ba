"""The engine in a process of its own (start_engine(process=True)): it steps whatever the API
process does, its outputs match the engine thread's, and its failures reach the callers."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import time
from operator import attrgetter

import pytest

from gpuworker.engine import AsyncLLMEngine, SamplingParams, start_engine
from gpuworker.engine.engine_process_client import EngineProcess
from gpuworker.engine.output_streams import EngineDeadError

# Generous: the machine running the tests may be busy with others.
DEADLINE_S = 120


@pytest.fixture
async def engine(tiny_checkpoint):
    engine = start_engine(tiny_checkpoint("llama"), num_kv_blocks=64, max_model_len=256, process=True)
    yield engine
    await asyncio.to_thread(engine.shutdown)


def _wait_for_steps(engine, target: int, write_fd: int) -> None:
    """In a forked watcher: write b"1" once the engine process has taken `target` steps (b"0" at the
    deadline). It reads the shared step counter, so it needs nothing of the API process."""
    deadline = time.monotonic() + DEADLINE_S
    while engine.num_steps < target and time.monotonic() < deadline:
        time.sleep(0.005)
    os.write(write_fd, b"1" if engine.num_steps >= target else b"0")


async def test_the_engine_process_steps_while_the_api_process_holds_the_gil(engine):
    """The property the engine process is for: a server whose threads are all busy (here, one holds
    the GIL without a break) does not stop the steps."""
    stream = engine.generate([1] * 10, SamplingParams(max_tokens=200, ignore_eos=True), "busy")
    await anext(stream)
    target = engine.num_steps + 20
    read_fd, write_fd = os.pipe()
    watcher = os.fork()
    if watcher == 0:
        try:
            _wait_for_steps(engine, target, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    # A read through ctypes.PyDLL keeps the GIL while it blocks: no thread of this process runs
    # (an engine thread could not step) until the watcher has seen 20 steps.
    answer = ctypes.create_string_buffer(1)
    assert ctypes.PyDLL(None).read(read_fd, answer, 1) == 1
    os.close(read_fd)
    os.waitpid(watcher, 0)
    assert answer.raw == b"1", "the engine process took no 20 steps while this process held the GIL"
    outputs = [out async for out in stream]
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 200


async def _final(engine, prompt, params, request_id):
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    return outputs


async def test_outputs_match_the_engine_thread(engine, tiny_checkpoint):
    """Deltas cross the pipe and the cumulative outputs are rebuilt: text, token ids, logprobs and
    finish reasons as the engine thread gives them, for n > 1 and a stop string too."""
    params = SamplingParams(temperature=0.0, max_tokens=24, n=2, logprobs=2, ignore_eos=True)
    async with AsyncLLMEngine(tiny_checkpoint("llama"), num_kv_blocks=64, max_model_len=256) as threaded:
        expected = await _final(threaded, [4, 8, 15, 16, 23, 42], params, "r")
    got = await _final(engine, [4, 8, 15, 16, 23, 42], params, "r")
    final, want = got[-1], expected[-1]
    assert final.finished and final.prompt_token_ids == want.prompt_token_ids
    for c, w in zip(final.outputs, want.outputs, strict=True):
        assert (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) == (
            w.index,
            w.text,
            w.token_ids,
            w.finish_reason,
            w.stop_reason,
        )
        assert c.logprobs == w.logprobs and len(c.logprobs) == 24
    for index in (0, 1):
        assert "".join(out.outputs[index].delta_text for out in got) == final.outputs[index].text
        assert [t for out in got for t in out.outputs[index].delta_token_ids] == final.outputs[index].token_ids
    text = final.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        stopped = (
            await _final(
                engine, [4, 8, 15, 16, 23, 42], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]), "s"
            )
        )[-1]
        assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]


def _fail_the_next_step(llm) -> None:
    """Run in the engine process: its next step raises (a stand-in for a kernel's failure)."""
    real_step = llm.step

    def failing_step():
        llm.step = real_step
        raise RuntimeError("injected step failure")

    llm.step = failing_step


async def test_a_failed_step_fails_its_requests_not_the_process(engine):
    stream = engine.generate([2] * 12, SamplingParams(max_tokens=200, ignore_eos=True), "doomed")
    await anext(stream)
    await engine.call(_fail_the_next_step)
    with pytest.raises(RuntimeError, match="injected step failure"):
        async for _ in stream:
            pass
    assert await engine.call(attrgetter("scheduler.block_manager.usage")) == 0.0
    after = [out async for out in engine.generate([2] * 12, SamplingParams(max_tokens=5, ignore_eos=True), "next")]
    assert after[-1].finished and len(after[-1].token_ids) == 5
    assert engine.dead is None


async def test_a_killed_engine_process_ends_streams_and_refuses_new_requests(engine):
    stream = engine.generate([3] * 12, SamplingParams(max_tokens=200, ignore_eos=True), "cut")
    await anext(stream)
    os.kill(engine.process.pid, signal.SIGKILL)

    async def drain() -> None:
        async for _ in stream:
            pass

    with pytest.raises(EngineDeadError, match="exited with code -9"):
        await asyncio.wait_for(drain(), DEADLINE_S)
    assert "exited with code -9" in engine.dead
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate([3] * 5, SamplingParams(max_tokens=2), "late"):
            pass
    with pytest.raises(EngineDeadError):
        await engine.call(attrgetter("num_generated_tokens"))
    # A server's stream aborts its request as it ends, in a task nobody awaits: that must not fail.
    await engine.abort("cut")


async def test_shutdown_stops_the_engine_process(engine):
    stream = engine.generate([1] * 10, SamplingParams(max_tokens=100, ignore_eos=True), "x")
    await anext(stream)
    await asyncio.to_thread(engine.shutdown)
    assert [out async for out in stream][-1].finish_reason == "abort"
    assert engine.process.process.exitcode == 0
    with pytest.raises(EngineDeadError, match="shut down"):
        await engine.abort("x")


async def test_a_call_that_cannot_cross_the_pipe_is_an_error_for_its_caller(engine):
    with pytest.raises(Exception, match="pickle|lambda"):
        await engine.call(lambda llm: llm.num_generated_tokens)
    assert await engine.call(attrgetter("num_generated_tokens")) == 0


async def test_a_bad_model_path_fails_the_load_and_leaves_no_process(tmp_path):
    with pytest.raises(Exception, match="missing"):
        await asyncio.to_thread(start_engine, tmp_path / "missing", process=True)
    assert not [p for p in multiprocessing.active_children() if p.name == "llm-engine"]


async def test_a_process_started_ahead_takes_its_output_and_its_load_later(tiny_checkpoint, tmp_path):
    """The spare's path: the engine process starts before the model is known, its output then moves
    to the replica's log (share_output), and the load goes to it."""
    process = await asyncio.to_thread(EngineProcess.start, "cpu")
    await asyncio.to_thread(process.wait_prepared)
    log = tmp_path / "replica.log"
    saved = os.dup(1), os.dup(2)
    with open(log, "wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        process.share_output()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    engine = await asyncio.to_thread(
        start_engine, tiny_checkpoint("llama"), num_kv_blocks=64, max_model_len=256, process=process
    )
    try:
        assert engine.process is process
        outputs = [out async for out in engine.generate([5] * 8, SamplingParams(max_tokens=3, ignore_eos=True), "a")]
        assert len(outputs[-1].token_ids) == 3
        await engine.call(_print_marker)
    finally:
        await asyncio.to_thread(engine.shutdown)
    # Written by the engine process to its stdout, which is now the replica's log (whatever logging
    # level an earlier test left: the engine's INFO lines may be filtered out).
    assert _MARKER in log.read_text()


_MARKER = "engine process output marker"


def _print_marker(llm) -> None:
    print(_MARKER, flush=True)


def _refuse_to_load() -> None:
    raise RuntimeError("this object cannot be read here")


class _Unreadable:
    """Pickles in the engine process, and fails as the API process reads it back."""

    def __reduce__(self):
        return _refuse_to_load, ()


def _unreadable_value(llm) -> _Unreadable:
    return _Unreadable()


async def test_a_message_the_api_side_cannot_read_fails_the_engine_instead_of_hanging(engine):
    with pytest.raises(EngineDeadError, match="could not be read"):
        await asyncio.wait_for(engine.call(_unreadable_value), DEADLINE_S)
    assert "could not be read" in engine.dead
    with pytest.raises(EngineDeadError):
        await engine.call(attrgetter("num_generated_tokens"))
