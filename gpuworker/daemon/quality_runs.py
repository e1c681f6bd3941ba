"""Quality measurements the control plane asks for (the MeasureQuality task): the perplexity command
(python -m gpuworker.quality) in a process of its own on the device the task names, its report, or
why it failed, posted back as it goes. A process of its own, not a replica's engine: a replica's
memory and batches stay as they are, and a crash of the measurement takes nothing else down."""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from gpuworker.contract.heartbeat import ContractError
from gpuworker.contract.quality import DONE, FAILED, RUNNING, QualityProgress, parse_perplexity_report
from gpuworker.contract.tasks import MeasureQuality
from gpuworker.daemon.model_paths import resolve_model_root_path

logger = logging.getLogger(__name__)

# The lines of the command's stderr a failure reports (its own "error: ..." line is the last).
ERROR_TAIL_LINES = 20
# How much less of the CPU a measurement gets than the daemon and the replicas it shares a host
# with (nice(1)): on a CPU worker it would otherwise slow every replica's tokens for minutes.
QUALITY_NICENESS = 10


def niced(argv: list[str]) -> list[str]:
    """`argv` run at QUALITY_NICENESS more than the daemon's niceness. nice(1) rather than a
    preexec_fn calling os.nice: the daemon runs threads, and Python code between fork and exec
    in a threaded process can deadlock."""
    return ["nice", "-n", str(QUALITY_NICENESS), *argv]


def quality_argv(task: MeasureQuality, checkpoint: Path) -> list[str]:
    """The perplexity command for `task` on the resolved `checkpoint`, at a lower CPU priority (niced)."""
    argv = [sys.executable, "-m", "gpuworker.quality", str(checkpoint)]
    argv += ["--device", "cpu" if task.gpu_index is None else f"cuda:{task.gpu_index}"]
    if task.quantization:
        argv += ["--quantization", task.quantization]
    if task.window is not None:
        argv += ["--window", str(task.window)]
    if task.max_tokens is not None:
        argv += ["--max-tokens", str(task.max_tokens)]
    return niced(argv)


class QualityRuns:
    """Runs the measurements one at a time, in the order they came, in a thread that waits on each
    process (one at a time: each loads a whole model); `report(measurement_id, progress)` posts
    what happened (and retries as it sees fit)."""

    def __init__(
        self, *, model_roots: tuple[Path, ...], gpu_count: int, report: Callable[[int, QualityProgress], None]
    ) -> None:
        self.model_roots, self.gpu_count, self._report = model_roots, gpu_count, report
        self._lock = threading.Lock()
        self._queue: queue.Queue[MeasureQuality | None] = queue.Queue()
        self._accepted: set[int] = set()
        self._process: subprocess.Popen | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="quality-runs", daemon=True)
        self._thread.start()

    def start(self, task: MeasureQuality) -> None:
        """Queue `task` unless it came before (a repeated message changes nothing)."""
        with self._lock:
            if self._closed or task.measurement_id in self._accepted:
                return
            self._accepted.add(task.measurement_id)
        self._queue.put(task)

    def close(self) -> None:
        """Stop the measurement in progress (reported failed), drop those queued (their worker went
        away, which the control plane notes when they are asked for again), and end the thread."""
        with self._lock:
            self._closed = True
            if self._process is not None:
                self._process.kill()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            with self._lock:
                if self._closed:
                    return
            self._run(task)

    def _problem(self, task: MeasureQuality) -> tuple[Path | None, str | None]:
        if task.gpu_index is not None and task.gpu_index >= self.gpu_count:
            return None, f"gpu_index {task.gpu_index} does not exist on this worker (it has {self.gpu_count} GPU(s))"
        return resolve_model_root_path(task.model_path, self.model_roots)

    def _run(self, task: MeasureQuality) -> None:
        checkpoint, problem = self._problem(task)
        if problem is None:
            self._report(task.measurement_id, QualityProgress(state=RUNNING))
            progress = self._measure(task, checkpoint)
        else:
            progress = QualityProgress(state=FAILED, error=problem)
        logger.info("quality measurement %d %s %s", task.measurement_id, progress.state, progress.error)
        self._report(task.measurement_id, progress)

    def _measure(self, task: MeasureQuality, checkpoint: Path) -> QualityProgress:
        try:
            with self._lock:
                if self._closed:
                    return QualityProgress(state=FAILED, error="the worker daemon stopped before the measurement began")
                self._process = process = subprocess.Popen(
                    quality_argv(task, checkpoint), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            out, err = process.communicate()
        except OSError as exc:
            return QualityProgress(state=FAILED, error=f"could not start the perplexity command: {exc}")
        finally:
            with self._lock:
                self._process = None
        if process.returncode != 0:
            tail = "\n".join(err.strip().splitlines()[-ERROR_TAIL_LINES:])
            return QualityProgress(
                state=FAILED, error=f"the perplexity command exited with status {process.returncode}: {tail}"
            )
        try:
            report = parse_perplexity_report(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError, ContractError) as exc:
            return QualityProgress(state=FAILED, error=f"the perplexity command printed no report it could read: {exc}")
        return QualityProgress(state=DONE, report=report)
