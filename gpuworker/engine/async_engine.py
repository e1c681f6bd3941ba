"""AsyncLLMEngine: the engine loop in a background thread, streamed per request to asyncio.

    engine = start_engine("/models/llama", device="cuda")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=64), "req-1"):
        print(out.outputs[0].delta_text, end="")

Only the engine thread touches the LLMEngine: adds and aborts travel to it as commands and run
between steps, so their errors (ValueError for bad input) come back to the caller. Cancelling the
consuming task, or leaving the `async for` early, aborts the request and frees its KV blocks.

Outputs reach the consumers' event loop once per step for all their requests (one wake-up, not
one per request). A consumer that falls behind finds one output for the steps it missed, their
deltas joined (`merge_outputs`), so a busy server sends fewer, larger stream chunks instead of
building a backlog.

`start_engine(model, process=True)` gives this interface over an engine in a process of its own
(ProcessLLMEngine, engine_process_client.py), for a server whose own work would otherwise slow the
steps through the GIL; `start_engine(model)` an AsyncLLMEngine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuworker.engine.engine_process_client import EngineProcess, ProcessLLMEngine
from gpuworker.engine.llm_engine import LLMEngine
from gpuworker.engine.output_streams import Deliveries, EngineDeadError, OutputStream, StreamingEngine
from gpuworker.engine.prompts import TokenizedPrompt
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.structured_output import StructuredOutput

if TYPE_CHECKING:  # the image inputs only pass through
    from gpuworker.engine.multimodal import ImageInput

logger = logging.getLogger(__name__)


def start_engine(
    model: str | Path, *, process: bool | EngineProcess = False, **config: Any
) -> AsyncLLMEngine | ProcessLLMEngine:
    """Load the engine for a server. process=False: an AsyncLLMEngine, the engine stepping in a
    thread of this process. process=True (or an EngineProcess started ahead, which then loads it):
    a ProcessLLMEngine, the same interface over an engine in a process of its own, whose steps no
    work of this process's threads can slow down. `config`: EngineConfig's fields."""
    if process:
        return ProcessLLMEngine(model, process=process, **config)
    return AsyncLLMEngine(model, **config)


class AsyncLLMEngine(StreamingEngine):
    """The engine stepping in a thread of this process (`engine`, the LLMEngine, is the thread's)."""

    def __init__(self, model: str | Path | None = None, *, engine: LLMEngine | None = None, **config: Any) -> None:
        if (model is None) == (engine is None):
            raise ValueError("pass either a model path or an engine")
        self.engine = engine if engine is not None else LLMEngine(model, **config)
        self.prompts = self.engine.prompts
        # Read before the loop starts: the timings up to ready, not those of the deferred warm-up.
        self.facts = self.engine.facts
        self._commands: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        # request id -> its stream; touched only by the engine thread.
        self._streams: dict[str, OutputStream] = {}
        self._deliveries = Deliveries()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    async def abort(self, request_id: str) -> None:
        """Abort a request; when this returns its KV blocks are free."""
        await self._call(lambda: self._abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (e.g. to read stats consistently)."""
        return await self._call(lambda: fn(self.engine))

    def failure(self) -> str | None:
        workers = self.engine.workers
        gone = workers.gone() if workers is not None else ""
        return f"tensor-parallel {gone}" if gone else None

    def shutdown(self) -> None:
        """Stop the loop thread (unfinished requests are aborted) and the engine's worker ranks."""
        if self._stopped:
            return
        self._stopped = True
        self._commands.put(None)
        self._thread.join()
        self.engine.shutdown()

    async def _compile_grammar(self, structured: StructuredOutput) -> None:
        # A new schema compiles here, off the engine thread, so running streams do not stall.
        await asyncio.to_thread(self.engine.compile_grammar, structured)

    async def _add(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        params: SamplingParams | None,
        outputs: OutputStream,
        images: list[ImageInput] | None = None,
    ) -> None:
        def add() -> None:
            self.engine.add_request(request_id, prompt, params, images=images)
            self._streams[request_id] = outputs

        await self._call(add)

    def _abort_soon(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    # -- engine thread --------------------------------------------------------------------------

    def _submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        if self._stopped:
            future.set_exception(EngineDeadError("the engine has been shut down"))
        else:
            self._commands.put((fn, future))
        return future

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and output is not None:
            self._deliveries.deliver([(stream, output)])

    def _loop(self) -> None:
        while True:
            # Wait for a command only when there is nothing to step, nor any warm-up left to do.
            idle = not self.engine.has_unfinished_requests()
            for command in self._drain(block=idle and not self.engine.has_deferred_warm_up):
                if command is None:
                    self._shut_down_requests()
                    return
                fn, future = command
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # handed to the caller
                        future.set_exception(exc)
            if self.engine.has_unfinished_requests():
                self._step()
            elif self.engine.has_deferred_warm_up:
                self.engine.do_deferred_warm_up()

    def _drain(self, block: bool) -> list:
        commands = []
        try:
            commands.append(self._commands.get(block=block))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting all requests")
            failed = []
            for request_id in self.engine.unfinished_request_ids():
                self.engine.abort(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    failed.append((stream, exc))
            self._deliveries.deliver(failed)
            return
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            deliveries.append((stream, output))
        self._deliveries.deliver(deliveries)

    def _shut_down_requests(self) -> None:
        for request_id in self.engine.unfinished_request_ids():
            self._abort(request_id)
