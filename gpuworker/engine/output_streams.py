"""What both engine loops (a thread: async_engine, a process: engine_process_client) share with their
callers: a request's stream of outputs on the caller's event loop, their delivery from another
thread, and `generate` over them.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from gpuworker.engine.facts import EngineFacts
from gpuworker.engine.outputs import RequestOutput, merge_outputs
from gpuworker.engine.prompts import Prompt, PromptTokenizer, TokenizedPrompt
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.structured_output import StructuredOutput

if TYPE_CHECKING:  # the image inputs only pass through
    from gpuworker.engine.multimodal import ImageInput


class EngineDeadError(RuntimeError):
    """The engine can run no more steps (its process died, or it was shut down): requests in flight
    end with this error and new ones are refused with it."""


class OutputStream:
    """A request's outputs on its consumer's event loop, not yet taken. Consecutive outputs merge
    into one (merge_outputs; deltas: the request's outputs are output_kind="delta"); an error stays
    an item of its own, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, deltas: bool = False) -> None:
        self.loop = loop
        self.deltas = deltas
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:  # on the consumer's loop
        if self._items and isinstance(item, RequestOutput) and isinstance(self._items[-1], RequestOutput):
            self._items[-1] = merge_outputs(self._items[-1], item, deltas=self.deltas)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class Deliveries:
    """Hands items to their streams from another thread (an engine's): one call into each consumer
    loop, and no second one while the first has not run yet. Items that come meanwhile join the
    waiting batch, so an event loop that is behind (512 streams' chunks to write) is woken once,
    not once per step, and the delivering thread spends no self-pipe write (and no wait for the
    GIL after it) per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # consumer loop -> its items not yet put; a loop is here while its call is scheduled.
        self._waiting: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput | BaseException]]] = {}

    def deliver(self, deliveries: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
        to_wake = []
        with self._lock:
            for stream, item in deliveries:
                batch = self._waiting.get(stream.loop)
                if batch is None:
                    batch = self._waiting[stream.loop] = []
                    to_wake.append(stream.loop)
                batch.append((stream, item))
        for loop in to_wake:
            try:
                loop.call_soon_threadsafe(self._put_all, loop)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                with self._lock:
                    del self._waiting[loop]

    def _put_all(self, loop: asyncio.AbstractEventLoop) -> None:  # on the consumer's loop
        with self._lock:
            batch = self._waiting.pop(loop)
        for stream, item in batch:
            stream.put(item)


class StreamingEngine(ABC):
    """`generate` over an engine loop that runs elsewhere; the loop's side is the hooks below."""

    # The prompts' side of the engine: tokenize, render_chat and the tokenizer, safe from any thread.
    prompts: PromptTokenizer
    # What the engine is (its limits, vocabulary and start-up timings), fixed once it is ready.
    facts: EngineFacts
    # Why the engine can run no more steps (its process died), or None.
    dead: str | None = None

    @property
    def engine_pid(self) -> int | None:
        """The engine's own process, where it has one."""
        return None

    def failure(self) -> str | None:
        """Why the engine can run no more steps (its process or a tensor-parallel rank died), or None."""
        return self.dead

    async def generate(
        self,
        prompt: Prompt | TokenizedPrompt,
        params: SamplingParams | None,
        request_id: str,
        images: list[ImageInput] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield an output each step the request advances; the last one has finished=True.
        images: as LLMEngine.add_request takes them (engine.multimodal)."""
        outputs = OutputStream(asyncio.get_running_loop(), deltas=params is not None and params.output_kind == "delta")
        if not isinstance(prompt, TokenizedPrompt):
            # Tokenizing (or checking) megabytes takes seconds: neither on the caller's event loop,
            # which serves other streams, nor on the engine thread, which steps them.
            prompt = await asyncio.to_thread(self.prompts.tokenize, prompt)
        if params is not None and params.structured_output is not None:
            await self._compile_grammar(params.structured_output)
        await self._add(request_id, prompt, params, outputs, images)
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
    async def _add(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        params: SamplingParams | None,
        outputs: OutputStream,
        images: list[ImageInput] | None = None,
    ) -> None:
        """Add the request to the engine, its outputs to go to `outputs`; ValueError for bad input."""

    @abstractmethod
    def _abort_soon(self, request_id: str) -> None:
        """Ask for an abort without waiting for it (a cancelled task cannot await)."""
