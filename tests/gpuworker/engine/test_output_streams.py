"""Delivering outputs from an engine's thread to the streams on a consumer's event loop."""

from __future__ import annotations

import asyncio
import threading

from gpuworker.engine.output_streams import Deliveries, OutputStream
from gpuworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _output(token_id: int, finished: bool = False) -> RequestOutput:
    text = chr(ord("a") + token_id)
    return RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=[1], finished=finished, num_cached_tokens=0,
        outputs=[CompletionOutput(index=0, text=text, token_ids=[token_id], finish_reason=None,
                                  delta_text=text, delta_token_ids=[token_id])],
        metrics=RequestMetrics(arrival_time=0.0, first_token_time=None, finish_time=None, gpu_time_s=0.0,
                               num_preemptions=0))


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
            target=lambda: [deliveries.deliver([(stream, _output(k, finished=k == 2))]) for k in range(3)])
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
