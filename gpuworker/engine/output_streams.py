"""What both engine loops (a thread: async_engine, a process: engine_process) share with their
callers: a request's stream of outputs on the caller's event loop, their delivery from another
thread, and `generate` over them.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from gpuworker.engine.outputs import RequestOutput, merge_outputs
from gpuworker.engine.prompts import Prompt, TokenizedPrompt
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.structured_output import StructuredOutput


class EngineDeadError(RuntimeError):
    """The engine can run no more steps (its process died, or it was shut down): requests in flight
    end with this error and new ones are refused with it."""


class OutputStream:
    """A request's outputs on its consumer's event loop, not yet taken. Consecutive outputs merge
    into one; an error stays an item of its own, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:  # on the consumer's loop
        if self._items and isinstance(item, RequestOutput) and isinstance(self._items[-1], RequestOutput):
            self._items[-1] = merge_outputs(self._items[-1], item)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


def _put_all(deliveries: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    for stream, item in deliveries:
        stream.put(item)


def deliver(deliveries: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    """Hand items to their streams from another thread: one call into each consumer loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass  # the consumer's loop is closed: nobody is listening any more


class StreamingEngine(ABC):
    """`generate` over an engine loop that runs elsewhere; the loop's side is the hooks below."""

    engine: Any  # what the caller may read of the engine: tokenize, tokenizer, config, ...
    # Why the engine can run no more steps (its process died), or None.
    dead: str | None = None

    @property
    def engine_pid(self) -> int | None:
        """The engine's own process, where it has one."""
        return None

    async def generate(self, prompt: Prompt | TokenizedPrompt, params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield an output each step the request advances; the last one has finished=True."""
        outputs = OutputStream(asyncio.get_running_loop())
        if not isinstance(prompt, TokenizedPrompt):
            # Tokenizing (or checking) megabytes takes seconds: neither on the caller's event loop,
            # which serves other streams, nor on the engine thread, which steps them.
            prompt = await asyncio.to_thread(self.engine.tokenize, prompt)
        if params is not None and params.structured_output is not None:
            await self._compile_grammar(params.structured_output)
        await self._add(request_id, prompt, params, outputs)
        finished = False
        try:
            while True:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if not finished:
                # Not awaited: this also runs when the task is being cancelled.
                self._abort_soon(request_id)

    async def __aenter__(self) -> StreamingEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.shutdown)

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request; when this returns its KV blocks are free."""

    @abstractmethod
    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(LLMEngine) in the engine loop between steps; its value."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine loop (unfinished requests are aborted); later calls are refused."""

    @abstractmethod
    async def _compile_grammar(self, structured: StructuredOutput) -> None:
        """Compile a request's grammar where the engine loop finds it, without stalling its steps."""

    @abstractmethod
    async def _add(self, request_id: str, prompt: TokenizedPrompt, params: SamplingParams | None,
                   outputs: OutputStream) -> None:
        """Add the request to the engine, its outputs to go to `outputs`; ValueError for bad input."""

    @abstractmethod
    def _abort_soon(self, request_id: str) -> None:
        """Ask for an abort without waiting for it (a cancelled task cannot await)."""
