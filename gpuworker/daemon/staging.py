"""Weight staging: the daemon keeps the checkpoints the control plane names (StageWeights, first
ones first) warm in the page cache within its byte budget, so a replica started for a scale-up
reads host memory instead of a cold disk. What falls out of the list is let go (its pages advised
DONTNEED); pages the kernel dropped under memory pressure are read again on the next refresh.

One thread does the reading; stage() only hands it the new list, so a Celery task never waits on
a disk. report() is what the heartbeat carries: path, bytes, how, and the share resident now.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from gpuworker.checkpoint_files import READ_BYTES, advise, checkpoint_files, resident_fraction
from gpuworker.contract.heartbeat import StagedWeights, Staging
from gpuworker.contract.tasks import StageWeights
from gpuworker.daemon.model_paths import resolve_model_root_path

logger = logging.getLogger(__name__)

STAGE_BUDGET_ENV = "GPUSERVE_STAGE_BUDGET_BYTES"
REFRESH_S = 10.0  # how often residency is measured and dropped pages read again


@dataclass
class _Staged:
    path: str
    files: list[Path]
    bytes: int
    resident_fraction: float = 0.0


class WeightStager:
    def __init__(self, *, budget_bytes: int, model_roots: tuple[Path, ...], refresh_s: float = REFRESH_S) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the staging budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes, self.model_roots, self.refresh_s = budget_bytes, tuple(model_roots), refresh_s
        self._wanted: tuple[str, ...] = ()
        self._generation = 0  # bumped by stage(): a warm-up in progress stops for the new list
        self._staged: dict[str, _Staged] = {}
        self._report = Staging(budget_bytes=budget_bytes)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-stager", daemon=True)

    # -- called from other threads ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stage(self, task: StageWeights) -> None:
        with self._lock:
            self._wanted, self._generation = task.model_paths, self._generation + 1
        self._wake.set()

    def report(self) -> Staging:
        return self._report

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # -- the stager thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self.apply()
            except Exception:  # a bad path or disk error must not end staging for the rest
                logger.exception("weight staging failed")
            self._wake.wait(self.refresh_s)
            self._wake.clear()

    def apply(self) -> None:
        """Make the staged set the wanted list's head that fits the budget, read what is not
        resident, and measure residency. Runs on the stager thread (tests call it directly)."""
        with self._lock:
            wanted, generation = self._wanted, self._generation
        keep: dict[str, _Staged] = {}
        used = 0
        for path in wanted if self.budget_bytes else ():
            staged = self._staged.get(path) or self._resolve(path)
            if staged is None:
                continue
            if used + staged.bytes > self.budget_bytes:
                logger.info(
                    "staging: %s (%d bytes) does not fit the budget (%d of %d bytes used)",
                    path,
                    staged.bytes,
                    used,
                    self.budget_bytes,
                )
                continue
            keep[path], used = staged, used + staged.bytes
        for path, staged in self._staged.items():
            if path not in keep:
                advise(staged.files, os.POSIX_FADV_DONTNEED)
                logger.info("staging: let go of %s", path)
        self._staged = keep
        for staged in keep.values():
            staged.resident_fraction = resident_fraction(staged.files)
            if staged.resident_fraction < 1.0 and not self._warm(staged, generation):
                break  # a new list arrived: the next apply() serves it
        self._publish()

    def _resolve(self, path: str) -> _Staged | None:
        resolved, problem = resolve_model_root_path(path, self.model_roots)
        if problem is None:
            try:
                files = checkpoint_files(resolved)
                return _Staged(path, files, sum(f.stat().st_size for f in files))
            except (OSError, ValueError) as exc:
                problem = str(exc)
        logger.warning("staging: skipping %s: %s", path, problem)
        return None

    def _warm(self, staged: _Staged, generation: int) -> bool:
        """Read the files through the page cache; False if stage() changed the list meanwhile."""
        logger.info(
            "staging: reading %s (%d bytes, %.0f%% resident)", staged.path, staged.bytes, 100 * staged.resident_fraction
        )
        advise(staged.files, os.POSIX_FADV_WILLNEED)
        buffer = bytearray(READ_BYTES)
        for file in staged.files:
            try:
                with open(file, "rb", buffering=0) as f:
                    while f.readinto(buffer):
                        if self._generation != generation or self._closed.is_set():
                            return False
            except OSError as exc:
                logger.warning("staging: reading %s failed: %s", file, exc)
        staged.resident_fraction = resident_fraction(staged.files)
        self._publish()
        return True

    def _publish(self) -> None:
        self._report = Staging(
            budget_bytes=self.budget_bytes,
            models=tuple(
                StagedWeights(
                    path=s.path, bytes=s.bytes, how="page_cache", resident_fraction=round(s.resident_fraction, 4)
                )
                for s in self._staged.values()
            ),
        )
