"""What runs in the engine process (the API process's side, its client: engine_process_client.py):
prepare the device, load the engine when told, then run its loop: commands between steps, ONE
message per step with all its requests' outputs (as deltas: `wire`), until the API process says
stop or goes away (its end of the pipe closes).
The loop never writes to the pipe itself: an outbox thread does, and while the API process is
behind, new steps' outputs merge into the outputs message still waiting (`merge_wire`).
The wire itself is described in engine_process_client.py."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing import reduction
from typing import Any

from gpuworker.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

# An idle engine process looks at its pipe (and its tensor-parallel ranks) this often.
IDLE_POLL_S = 0.5


def error_payload(exc: BaseException) -> tuple[str, str]:
    """An exception as plain strings: any exception can cross, and bad input stays a ValueError."""
    if isinstance(exc, ValueError):
        return "ValueError", str(exc)
    return "RuntimeError", f"{type(exc).__name__}: {exc}"


def error(payload: tuple[str, str]) -> Exception:
    kind, message = payload
    return ValueError(message) if kind == "ValueError" else RuntimeError(message)


def wire(output: RequestOutput) -> tuple:
    """A step's output as its deltas: (request id, finished, cached tokens, metrics, completions),
    in tuples, lists, strings and numbers only: 512 of them pickle and unpickle several times faster
    than the same in dataclasses (no class to look up, no __dict__ per object). The API side reads
    them back with metrics_from_wire and logprobs_from_wire."""
    completions = []
    for c in output.outputs:
        added = len(c.delta_token_ids)
        logprobs = None
        if c.logprobs is not None:
            logprobs = [(e.token_id, e.logprob, e.top_logprobs) for e in c.logprobs[len(c.logprobs) - added :]]
        completions.append((c.index, c.delta_text, c.delta_token_ids, c.finish_reason, c.stop_reason, logprobs))
    m = output.metrics
    metrics = (
        m.arrival_time,
        m.first_token_time,
        m.finish_time,
        m.gpu_time_s,
        m.num_preemptions,
        m.first_scheduled_time,
    )  # RequestMetrics' fields in their order
    return output.request_id, output.finished, output.num_cached_tokens, metrics, completions


def metrics_from_wire(metrics: tuple) -> RequestMetrics:
    return RequestMetrics(*metrics)


def logprobs_from_wire(entries: list[tuple]) -> list[TokenLogprob]:
    return [TokenLogprob(*entry) for entry in entries]


def merge_wire(older: tuple | RequestOutput, newer: tuple | RequestOutput) -> tuple | RequestOutput:
    """One wired output standing for two consecutive ones of a request: the newer state, with each
    completion's deltas (text, token ids, logprobs) of both joined in order."""
    if isinstance(newer, RequestOutput):  # final_only: its one output is the whole answer
        return newer
    request_id, finished, num_cached_tokens, metrics, completions = newer
    merged = {c[0]: c for c in older[4]}
    for index, delta_text, delta_ids, finish_reason, stop_reason, logprobs in completions:
        before = merged.get(index)
        if before is not None:
            delta_text, delta_ids = before[1] + delta_text, before[2] + delta_ids
            if logprobs is not None and before[5] is not None:
                logprobs = before[5] + logprobs
        merged[index] = (index, delta_text, delta_ids, finish_reason, stop_reason, logprobs)
    return request_id, finished, num_cached_tokens, metrics, list(merged.values())


class _Outbox:
    """The engine process's messages to the API process, written in order by a thread of their own,
    so that a step never waits on a full pipe (an API process slow to read). Outputs wait as a
    dict (request id -> wired output) that the next step's outputs merge into until the writer
    takes it; other messages are pickled when put, so a value that cannot cross fails its sender."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._ready = threading.Condition()
        # bytes (pickled), or ["outputs", {request id: wired}, failure] still open to merging.
        self._pending: deque[bytes | list] = deque()
        self._closed = False
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="llm-engine-outbox", daemon=True)
        self._writer.start()

    def put(self, message: tuple) -> None:
        data = reduction.ForkingPickler.dumps(message)
        with self._ready:
            self._check()
            self._pending.append(data)
            self._ready.notify()

    def put_outputs(self, wired: list, failure: tuple[list[str], tuple[str, str]] | None) -> None:
        with self._ready:
            self._check()
            last = self._pending[-1] if self._pending else None
            if failure is None and isinstance(last, list) and last[2] is None:
                outputs = last[1]  # the API process has not taken the previous step's yet
                for output in wired:
                    request_id = _request_id(output)
                    before = outputs.get(request_id)
                    outputs[request_id] = output if before is None else merge_wire(before, output)
            else:
                self._pending.append(["outputs", {_request_id(output): output for output in wired}, failure])
            self._ready.notify()

    def close(self) -> None:
        """Write what is waiting (unless the API process is gone), then stop the writer."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._writer.join()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error  # the API process is gone: the loop stops as if its own send failed

    def _write_loop(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closed:
                    self._ready.wait()
                if not self._pending:
                    return
                message = self._pending.popleft()
            try:
                if isinstance(message, list):
                    kind, outputs, failure = message
                    message = reduction.ForkingPickler.dumps((kind, list(outputs.values()), failure))
                self.conn.send_bytes(message)
            except Exception as exc:  # the API process is gone (or, never seen, outputs that cannot cross)
                if not isinstance(exc, (EOFError, OSError)):
                    logger.exception("writing to the API process failed: stopping")
                    exc = OSError(f"writing to the API process failed: {type(exc).__name__}: {exc}")
                with self._ready:
                    self._error = exc
                    self._pending.clear()
                return


def _request_id(output: tuple | RequestOutput) -> str:
    return output.request_id if isinstance(output, RequestOutput) else output[0]


def engine_main(conn: Any, device: str, steps: Any, log_level: int) -> None:
    """The engine process: prepare the device, load when told, then step until told to stop."""
    # Ctrl-C in a terminal reaches the whole process group: the API process drains, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    try:
        import torch

        # What the load imports, before the load: the engine, the models and the loader, and the
        # tokenizer's modules (the engine detokenizes), all lazily imported otherwise (seconds).
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

        from gpuworker.engine.llm_engine import LLMEngine
        from gpuworker.models.loader import report_load_progress

        if device.startswith("cuda"):
            import gpuworker.attention.triton_backend  # noqa: F401  Triton and the kernels (from its cache)

            torch.cuda.init()
            torch.empty(0, device=device)
        send(("prepared", os.getpid()))
        while (message := conn.recv())[0] == "output":
            # The API process's stdout and stderr changed (a spare took its load): ours follow.
            fd = reduction.recv_handle(conn)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
    except EOFError:
        return
    except Exception as exc:
        send(("failed", error_payload(exc)))
        return
    if message[0] != "load":
        return
    _, model, config = message
    try:
        with report_load_progress(lambda fraction: send(("progress", fraction))):
            engine = LLMEngine(model, **config)
    except Exception as exc:
        logger.exception("the engine process could not load %s", model)
        send(("failed", error_payload(exc)))
        return
    try:
        send(
            (
                "ready",
                {
                    "config": engine.config,
                    "model_config": engine.model_config,
                    "load_timings": dict(engine.load_timings),
                },
            )
        )
        outbox = _Outbox(conn)
        try:
            _EngineLoop(engine, conn, outbox, steps).run()
        finally:
            outbox.close()
    except (EOFError, OSError):
        pass  # the API process is gone: nobody to answer
    finally:
        engine.shutdown()


class _EngineLoop:
    """The engine process's loop: commands between steps, one outputs message per step."""

    def __init__(self, engine: Any, conn: Any, outbox: _Outbox, steps: Any) -> None:
        self.engine, self.conn, self.outbox, self.steps = engine, conn, outbox, steps
        # Grammars compile on a thread of their own, so the steps of running streams go on meanwhile
        # (add_request then finds the grammar compiled).
        self.compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.final_only: set[str] = set()

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests() or engine.has_deferred_warm_up
            if self.conn.poll(0 if busy else IDLE_POLL_S):
                while True:
                    if not self.handle(self.conn.recv()):
                        self.shut_down_requests()
                        return
                    if not self.conn.poll(0):
                        break
            if engine.workers is not None and (gone := engine.workers.gone()):
                self.outbox.put(("fatal", f"tensor-parallel {gone}"))
                return
            if engine.has_unfinished_requests():
                self.step()
            elif engine.has_deferred_warm_up:
                engine.do_deferred_warm_up()

    def handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "shutdown":
            return False
        command_id = message[1]
        if kind == "compile":
            self.compiler.submit(self.compile, command_id, message[2])
            return True
        try:
            if kind == "add":
                request_id, prompt, params, images = (*message[2:5], message[5] if len(message) > 5 else None)
                if params is None or params.output_kind == "cumulative":
                    # The API side accumulates (engine_process_client._Assembly): no step copies a stream's
                    # tokens and logprobs so far here.
                    params = replace(params or SamplingParams(), output_kind="delta")
                self.engine.add_request(request_id, prompt, params, images=images)
                if params is not None and params.output_kind == "final_only":
                    self.final_only.add(request_id)
                value = None
            elif kind == "abort":
                output = self.engine.abort(message[2])
                if output is not None:
                    self.send_outputs([output], None)
                value = None
            elif kind == "call":
                value = message[2](self.engine)
            else:
                raise ValueError(f"unknown command {kind!r}")
        except Exception as exc:
            self.reply(command_id, False, error_payload(exc))
        else:
            self.reply(command_id, True, value)
        return True

    def compile(self, command_id: int, structured: StructuredOutput) -> None:
        try:
            self.engine.compile_grammar(structured)
        except Exception as exc:
            self.reply(command_id, False, error_payload(exc))
        else:
            self.reply(command_id, True, None)

    def reply(self, command_id: int, ok: bool, value: Any) -> None:
        try:
            self.outbox.put(("reply", command_id, ok, value))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # a call's value that cannot cross
            self.outbox.put(("reply", command_id, False, error_payload(exc)))

    def send_outputs(self, outputs: list[RequestOutput], failure: tuple[list[str], tuple[str, str]] | None) -> None:
        wired = []
        for output in outputs:
            if output.request_id in self.final_only:
                if output.finished:
                    self.final_only.discard(output.request_id)
                wired.append(output)
            else:
                wired.append(wire(output))
        self.outbox.put_outputs(wired, failure)

    def step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting its requests")
            failed = engine.unfinished_request_ids()
            for request_id in failed:
                engine.abort(request_id)
                self.final_only.discard(request_id)
            self.steps.value += 1
            self.send_outputs([], (failed, error_payload(exc)))
            return
        self.steps.value += 1
        if outputs:
            self.send_outputs(outputs, None)

    def shut_down_requests(self) -> None:
        outputs = [
            output
            for request_id in self.engine.unfinished_request_ids()
            if (output := self.engine.abort(request_id)) is not None
        ]
        if outputs:
            self.send_outputs(outputs, None)
