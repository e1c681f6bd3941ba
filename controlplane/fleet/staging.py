"""Which checkpoints each worker keeps warm in host memory (StageWeights), decided without the ORM.

A scale-up is fast when the new replica's weights are in the worker's page cache. The models
likely to be scaled are those with headroom (desired < max_replicas), busiest first; a worker
stages those it can load (the checkpoint is under its model roots) but does not run yet, within
its staging budget. Traffic is the requests the gateways counted over the autoscaler's popularity
window (AUTOSCALE_POPULAR_WINDOW_SECONDS).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagingWorker:
    worker_id: int
    budget_bytes: int  # what the daemon reports (--stage-budget-bytes); 0: no staging
    model_paths: frozenset[str]  # checkpoints it found under its model roots
    running_paths: frozenset[str]  # checkpoints of its live replicas: their weights are loaded already


@dataclass(frozen=True)
class StagingCandidate:
    model_path: str
    weight_bytes: int  # an estimate; the daemon measures the files and keeps within its budget
    traffic: float
    headroom: bool  # desired_replicas < max_replicas: it may be scaled up


def plan_staging(workers: list[StagingWorker], candidates: list[StagingCandidate]) -> dict[int, tuple[str, ...]]:
    """worker id -> the checkpoints it should keep warm, most wanted first."""
    ordered = sorted((c for c in candidates if c.headroom), key=lambda c: (-c.traffic, c.model_path))
    plan = {}
    for worker in workers:
        chosen, used = [], 0
        for candidate in ordered:
            if candidate.model_path not in worker.model_paths or candidate.model_path in worker.running_paths:
                continue
            if used + candidate.weight_bytes > worker.budget_bytes:
                continue
            chosen.append(candidate.model_path)
            used += candidate.weight_bytes
        plan[worker.worker_id] = tuple(chosen)
    return plan
