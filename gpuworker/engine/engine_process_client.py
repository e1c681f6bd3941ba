"""The API process's side of an engine in a process of its own (the engine process's side:
engine_process_main.py): ProcessLLMEngine, AsyncLLMEngine's interface over it, which
`start_engine(model, process=True)` builds, and EngineProcess, the handle that starts and stops it.

Why: in one process the HTTP event loop (SSE chunks, JSON, 512 streams' deltas every ~25 ms step)
and the engine thread share one GIL; on an H200 at 512 streams the steps ran 2.5x slower than
offline (TPOT 62 ms vs 25 ms; BENCHMARKS.md). Here the engine process schedules, runs the model, steps
and detokenizes; the API process keeps HTTP, tokenization and chat templates (a PromptTokenizer
over its own copy of the tokenizer) and response formatting. This is the split vLLM V1 made.

The wire is a multiprocessing Pipe (a Unix socketpair; pickle):
  API -> engine   ("load", model, config) once; then (kind, command id, ...) with kind "add",
                  "abort", "call" (a picklable fn(LLMEngine)), "compile" (a grammar); ("shutdown",)
  engine -> API   ("prepared", pid), ("progress", fraction), ("ready", facts) | ("failed", error);
                  then ("outputs", outputs, failure) ONE message per step for all its requests,
                  ("reply", command id, ok, value), ("fatal", reason) before it stops on its own.
Outputs travel as deltas (the text and token ids a step added; the engine process asks its
LLMEngine for output_kind="delta", so no step copies a stream's tokens so far) in tuples of plain
values (engine_process_main.wire), and the API side rebuilds vLLM's cumulative RequestOutput, so a step's
message grows with the tokens it made, not with the streams' lengths. The engine process never
waits on the pipe: a thread of its own writes, and while the API process is behind, the outputs of
new steps merge into the message still waiting (so that at 512 streams the steps do not wait on an
API process busy with its HTTP streams).

How it starts: spawned (a fresh interpreter), early. `serve` starts it first thing, so its imports
of torch and the engine run alongside the API process's own imports and the checkpoint read-ahead;
a spare replica (replica/spare.py) starts it before any load, so torch, the engine and CUDA are
ready in it when the load comes, as the spare's own imports are. Fork would skip those
imports, but only from a process that has neither initialised CUDA nor started threads (the
tokenizer's and OpenMP's pools, the loader thread, the read-ahead): a fork of one that has may hang
or fail in the child, and the cost fork saves is paid before the load anyway when started early.

The engine process ends when the API process says so, or when its end of the pipe closes (the API
process died, even by SIGKILL): it notices between steps, so no orphan keeps the GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import reduction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gpuworker.engine.config import EngineConfig
from gpuworker.engine.engine_process_main import engine_main, error, logprobs_from_wire, metrics_from_wire
from gpuworker.engine.facts import EngineFacts
from gpuworker.engine.output_streams import Deliveries, EngineDeadError, OutputStream, StreamingEngine
from gpuworker.engine.outputs import CompletionOutput, RequestOutput
from gpuworker.engine.prompts import PromptTokenizer, TokenizedPrompt
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.structured_output import StructuredOutput

if TYPE_CHECKING:  # the image inputs only pass through
    from gpuworker.engine.multimodal import ImageInput

logger = logging.getLogger(__name__)

# A stopping engine process gets this long to abort its requests and stop its ranks, then SIGKILL.
STOP_GRACE_S = 10.0


class _Assembly:
    """A request's cumulative output on the API side, rebuilt from the deltas of its steps."""

    def __init__(self, prompt: TokenizedPrompt, accumulate: bool) -> None:
        self.prompt = prompt
        # False where the caller asked for output_kind="delta" itself: its outputs stay deltas.
        self.accumulate = accumulate
        self.texts: dict[int, str] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}

    def output(self, wire: tuple | RequestOutput) -> RequestOutput:
        if isinstance(wire, RequestOutput):  # final_only: the whole output, once
            return wire
        request_id, finished, num_cached_tokens, metrics, completions = wire
        outputs = []
        for index, delta_text, delta_ids, finish_reason, stop_reason, new_logprobs in completions:
            if new_logprobs is not None:
                new_logprobs = logprobs_from_wire(new_logprobs)
            if not self.accumulate:
                outputs.append(
                    CompletionOutput(
                        index=index,
                        text=delta_text,
                        token_ids=delta_ids,
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                        logprobs=new_logprobs,
                        delta_text=delta_text,
                        delta_token_ids=delta_ids,
                    )
                )
                continue
            text = self.texts[index] = self.texts.get(index, "") + delta_text
            token_ids = self.token_ids.setdefault(index, [])
            token_ids += delta_ids
            logprobs = None
            if new_logprobs is not None:
                logprobs = self.logprobs.setdefault(index, [])
                logprobs += new_logprobs
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(token_ids),
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                )
            )
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt.text,
            prompt_token_ids=self.prompt.token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=num_cached_tokens,
            metrics=metrics_from_wire(metrics),
        )


# -- the API side -------------------------------------------------------------------------------


class EngineProcess:
    """The API process's handle on an engine process: started (and its device prepared) before the
    model is known, loaded once, stopped with a deadline."""

    def __init__(self, process: Any, conn: Any, steps: Any, device: str) -> None:
        self.process, self.conn, self.steps, self.device = process, conn, steps, device
        self._prepared = False

    @classmethod
    def start(cls, device: str) -> EngineProcess:
        """Spawn the engine process for `device`; it logs at this process's level."""
        context = multiprocessing.get_context("spawn")
        api_end, engine_end = context.Pipe()
        # Steps taken, readable here without a command (it keeps counting while this process is busy).
        steps = context.RawValue("Q", 0)
        log_level = logging.getLogger().getEffectiveLevel()
        process = context.Process(target=engine_main, args=(engine_end, device, steps, log_level), name="llm-engine")
        process.start()
        engine_end.close()
        return cls(process, api_end, steps, device)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def num_steps(self) -> int:
        return self.steps.value

    def _recv(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(STOP_GRACE_S)
            raise EngineDeadError(
                f"the engine process (pid {self.pid}) exited with code {self.process.exitcode} before it was ready"
            ) from None

    def wait_prepared(self) -> None:
        """Wait until the engine process has imported the engine and initialised its device."""
        if self._prepared:
            return
        message = self._recv()
        if message[0] == "failed":
            raise error(message[1])
        self._prepared = True

    def share_output(self) -> None:
        """Point the engine process's stdout and stderr where this process's now go (before load)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.conn.send(("output",))
        reduction.send_handle(self.conn, 1, self.pid)

    def load(
        self, model: str | Path, config: dict[str, Any], on_progress: Callable[[float], None] | None = None
    ) -> tuple[PromptTokenizer, EngineFacts]:
        """Build the engine in the engine process; meanwhile this process loads the tokenizer. Returns
        this process's tokenization (over its own tokenizer) and the engine's facts as it became ready."""
        from gpuworker.engine.llm_engine import engine_tokenizer

        self.conn.send(("load", str(model), config))
        tokenizer_loading = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        tokenizer = tokenizer_loading.submit(engine_tokenizer, EngineConfig(model=str(model), **config))
        tokenizer_loading.shutdown(wait=False)
        self.wait_prepared()
        while True:
            message = self._recv()
            if message[0] == "progress":
                if on_progress is not None:
                    on_progress(message[1])
            elif message[0] == "failed":
                raise error(message[1])
            elif message[0] == "ready":
                ready = message[1]
                prompts = PromptTokenizer(tokenizer.result(), ready["model_config"], ready["config"])
                return prompts, EngineFacts.of(ready["config"], ready["model_config"], ready["load_timings"])

    def stop(self) -> None:
        """Ask the engine process to stop (it aborts its requests), then make sure it has."""
        try:
            self.conn.send(("shutdown",))
        except OSError:
            pass
        self.process.join(STOP_GRACE_S)
        if self.process.is_alive():
            logger.warning("the engine process (pid %d) did not stop within %.0fs: killing it", self.pid, STOP_GRACE_S)
            self.process.kill()
            self.process.join()
        self.conn.close()


class ProcessLLMEngine(StreamingEngine):
    """AsyncLLMEngine's interface over an engine process. `prompts` tokenizes in this process and
    `facts` are the engine's as it became ready; `call(fn)` runs a picklable fn(LLMEngine) in the
    engine process (operator.methodcaller / attrgetter, or a module-level function) and returns its
    value. Tensor-parallel ranks belong to the engine process, which reports their death as its own.

    A reader thread takes the engine's messages and hands each step's outputs to the streams'
    event loops (one wake-up per loop per step, merged for a stream that lags, as in the thread
    version); a sender thread writes commands, so a large prompt never blocks an event loop on
    the pipe. When the engine process dies, every stream in flight ends with EngineDeadError at
    once, and so does every later request: `dead` says why."""

    def __init__(self, model: str | Path | None = None, *, process: bool | EngineProcess = True, **config: Any) -> None:
        if model is None:
            raise ValueError("pass a model path: an engine object cannot move into another process")
        from gpuworker.models.loader import load_progress_callback

        self.process = (
            process if isinstance(process, EngineProcess) else EngineProcess.start(config.get("device", "cpu"))
        )
        try:
            self.prompts, self.facts = self.process.load(model, config, load_progress_callback())
        except BaseException:
            self.process.stop()
            raise
        self.dead: str | None = None
        self._stopped = False
        self._lock = threading.Lock()
        # request id -> its stream and its output so far; under _lock (the reader thread and callers).
        self._streams: dict[str, tuple[OutputStream, _Assembly]] = {}
        self._replies: dict[int, Future] = {}
        self._deliveries = Deliveries()
        self._command_ids = itertools.count()
        self._outbox: queue.Queue[tuple | None] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="llm-engine-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="llm-engine-read", daemon=True)
        self._sender.start()
        self._reader.start()

    @property
    def engine_pid(self) -> int:
        return self.process.pid

    @property
    def num_steps(self) -> int:
        """Steps the engine process has taken (shared memory: no command, no wait)."""
        return self.process.num_steps

    async def abort(self, request_id: str) -> None:
        if self.dead is not None and not self._stopped:
            return  # the engine process died: nothing of the request is left to free
        await asyncio.wrap_future(self._command("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self._command("call", fn))

    def shutdown(self) -> None:
        """Stop the engine process (unfinished requests are aborted) and its ranks; wait for it."""
        if self._stopped:
            return
        self._stopped = True
        self._outbox.put(None)
        self._sender.join()
        self.process.stop()
        self._reader.join(STOP_GRACE_S)

    # -- the hooks of StreamingEngine.generate -------------------------------------------------

    async def _compile_grammar(self, structured: StructuredOutput) -> None:
        await asyncio.wrap_future(self._command("compile", structured))

    async def _add(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        params: SamplingParams | None,
        outputs: OutputStream,
        images: list[ImageInput] | None = None,
    ) -> None:
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (outputs, _Assembly(prompt, accumulate=not outputs.deltas))
        try:
            await asyncio.wrap_future(self._command("add", request_id, prompt, params, images))
        except BaseException as exc:
            with self._lock:
                entry = self._streams.get(request_id)
                if entry is not None and entry[0] is outputs:
                    del self._streams[request_id]
            if isinstance(exc, asyncio.CancelledError):
                self._abort_soon(request_id)  # the add may have gone through meanwhile
            raise

    def _abort_soon(self, request_id: str) -> None:
        self._command("abort", request_id)

    # -- the pipe -------------------------------------------------------------------------------

    def _command(self, kind: str, *payload: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self.dead is not None or self._stopped:
                future.set_exception(EngineDeadError(self.dead or "the engine has been shut down"))
                return future
            command_id = next(self._command_ids)
            self._replies[command_id] = future
        self._outbox.put((kind, command_id, *payload))
        return future

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.process.conn.send(message)
            except OSError:
                return  # the engine process is gone: the reader sees it too and fails everything
            except Exception as exc:  # e.g. a call's fn that cannot be pickled
                with self._lock:
                    future = self._replies.pop(message[1], None)
                if future is not None:
                    future.set_exception(exc)

    def _read_loop(self) -> None:
        reason = None
        try:
            while True:
                message = self.process.conn.recv()
                if message[0] == "outputs":
                    self._on_outputs(message[1], message[2])
                elif message[0] == "reply":
                    self._on_reply(*message[1:])
                elif message[0] == "fatal":
                    reason = f"the engine process stopped: {message[1]}"
                    break
        except (EOFError, OSError):
            pass
        except Exception as exc:  # a message this side cannot take: no output could be trusted after it
            logger.exception("reading the engine process's messages failed")
            reason = f"the engine process's messages could not be read ({type(exc).__name__}: {exc})"
            self.process.process.kill()
        self._on_death(reason)

    def _on_reply(self, command_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            future = self._replies.pop(command_id, None)
        if future is None or not future.set_running_or_notify_cancel():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(error(value))

    def _on_outputs(self, wired: list, failure: tuple[list[str], tuple[str, str]] | None) -> None:
        deliveries: list[tuple[OutputStream, RequestOutput | BaseException]] = []
        with self._lock:
            for wire in wired:
                request_id = wire.request_id if isinstance(wire, RequestOutput) else wire[0]
                entry = self._streams.get(request_id)
                if entry is None:
                    continue
                output = entry[1].output(wire)
                if output.finished:
                    del self._streams[request_id]
                deliveries.append((entry[0], output))
            if failure is not None:
                request_ids, payload = failure
                for request_id in request_ids:
                    entry = self._streams.pop(request_id, None)
                    if entry is not None:
                        deliveries.append((entry[0], error(payload)))
        self._deliveries.deliver(deliveries)

    def _on_death(self, reason: str | None) -> None:
        self.process.process.join(STOP_GRACE_S if self._stopped else 1.0)
        if reason is None:
            reason = (
                "the engine has been shut down"
                if self._stopped
                else f"the engine process (pid {self.process.pid}) exited with code {self.process.process.exitcode}"
            )
        if not self._stopped:
            logger.error("%s: failing the requests in flight", reason)
        with self._lock:
            self.dead = reason
            replies, self._replies = self._replies, {}
            streams, self._streams = self._streams, {}
        for future in replies.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(reason))
        self._deliveries.deliver([(stream, EngineDeadError(reason)) for stream, _ in streams.values()])
