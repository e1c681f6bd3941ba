"""Delivering outputs from an engine's thread to the streams on a consumer's event loop."""

from __future__ import annotations

import asyncio
import threading

from gpuworker.engine.output_streams import Deliveries, OutputStream
from gpuworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob, join_deltas


def _output(token_id: int, finished: bool = False, logprobs: bool = False) -> RequestOutput:
    """A delta output (output_kind="delta": its text, token ids and logprobs are the step's) that is
    also a first step's cumulative output."""
    text = chr(ord("a") + token_id)
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1],
        finished=finished,
        num_cached_tokens=0,
        outputs=[
            CompletionOutput(
                index=0,
                text=text,
                token_ids=[token_id],
                finish_reason="stop" if finished else None,
                logprobs=[TokenLogprob(token_id, -float(token_id), [])] if logprobs else None,
                delta_text=text,
                delta_token_ids=[token_id],
            )
        ],
        metrics=RequestMetrics(
            arrival_time=0.0, first_token_time=None, finish_time=None, gpu_time_s=0.0, num_preemptions=0
        ),
    )


async def test_a_busy_loop_is_woken_once_for_the_steps_it_missed():
    """Three steps delivered while the consumer's loop is busy: one call into the loop (not three
    self-pipe writes from the engine's thread), and the stream finds the three steps' deltas."""
    loop = asyncio.get_running_loop()
    wake_ups = []
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counted(*args):  # the event loop is asyncio's: count what the engine's thread asks of it
        wake_ups.append(args)
        return call_soon_threadsafe(*args)

    loop.call_soon_threadsafe = counted
    try:
        stream, deliveries = OutputStream(loop), Deliveries()
        engine_thread = threading.Thread(
            target=lambda: [deliveries.deliver([(stream, _output(k, finished=k == 2))]) for k in range(3)]
        )
        engine_thread.start()
        engine_thread.join()  # this loop does nothing meanwhile: it is busy
        assert len(wake_ups) == 1
        merged = await stream.get()
        assert merged.finished and merged.outputs[0].delta_token_ids == [0, 1, 2]
        assert merged.outputs[0].delta_text == "abc"
        # Once it has run, the next delivery wakes it again.
        deliveries.deliver([(stream, _output(3))])
        assert len(wake_ups) == 2 and (await stream.get()).outputs[0].delta_token_ids == [3]
    finally:
        del loop.call_soon_threadsafe


async def test_delta_outputs_a_consumer_fell_behind_on_keep_every_steps_text_and_logprobs():
    # A delta output's text, token ids and logprobs are its step's: merged as cumulative outputs
    # are (the newer's state), the older step's would be lost.
    stream = OutputStream(asyncio.get_running_loop(), deltas=True)
    for k in range(3):
        stream.put(_output(k, finished=k == 2, logprobs=True))
    merged = (await stream.get()).outputs[0]
    assert (merged.text, merged.token_ids, merged.finish_reason) == ("abc", [0, 1, 2], "stop")
    assert [entry.token_id for entry in merged.logprobs] == [0, 1, 2]
    assert (merged.delta_text, merged.delta_token_ids) == ("abc", [0, 1, 2])


def test_joined_deltas_are_the_whole_answer():
    outputs = [_output(k, finished=k == 3) for k in range(4)]
    whole = join_deltas(outputs)
    assert whole.finished and whole.text == "abcd" and whole.token_ids == [0, 1, 2, 3]
    assert whole.num_generated_tokens == 4 and whole.outputs[0].logprobs is None
    assert join_deltas(outputs[:1]).text == "a"
