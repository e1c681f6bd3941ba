"""Placement and scale-down choices, as pure functions over a snapshot of the fleet (no ORM), so
the rules can be read and tested on their own; reconcile feeds them and acts on the result."""

from collections import Counter
from dataclasses import dataclass
from datetime import datetime


@dataclass
class Slot:
    """Somewhere a replica can run: one GPU of a worker, or a CPU-only worker's memory."""

    worker_id: int
    gpu_id: int | None
    gpu_index: int | None
    total_bytes: int
    used_bytes: int

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes


def plan_placements(
    *, slots: list[Slot], need_bytes: int, count: int,
    replicas_per_worker: Counter, replicas_per_slot: Counter,
) -> list[Slot]:
    """Up to `count` slots for new replicas of one deployment, each with `need_bytes` free.

    A deployment is spread across workers first, then across GPUs (a host going away should take
    as few of its replicas as possible), then onto the emptiest GPU, which leaves room for the
    KV cache to grow. Fewer than `count` come back when the fleet has no more room.
    """
    per_worker, per_slot = Counter(replicas_per_worker), Counter(replicas_per_slot)
    chosen = []
    for _ in range(count):
        fitting = [slot for slot in slots if slot.free_bytes >= need_bytes]
        if not fitting:
            break
        slot = min(fitting, key=lambda s: (
            per_worker[s.worker_id], per_slot[(s.worker_id, s.gpu_id)], -s.free_bytes, s.worker_id, s.gpu_index or 0,
        ))
        slot.used_bytes += need_bytes
        per_worker[slot.worker_id] += 1
        per_slot[(slot.worker_id, slot.gpu_id)] += 1
        chosen.append(slot)
    return chosen


@dataclass(frozen=True)
class Candidate:
    """A live replica that scale-down may remove, with its load from the latest heartbeat."""

    replica_id: int
    state: str
    created_at: datetime
    outstanding_requests: int


_REMOVE_FIRST = {"pending": 0, "loading": 1, "ready": 2}


def choose_to_remove(*, candidates: list[Candidate], count: int) -> list[int]:
    """The `count` least useful replicas: not yet serving before serving, then the least busy
    (draining it cuts the fewest requests short), then the newest."""
    ordered = sorted(candidates, key=lambda c: (
        _REMOVE_FIRST.get(c.state, 3), c.outstanding_requests, -c.created_at.timestamp(), -c.replica_id,
    ))
    return [c.replica_id for c in ordered[:max(0, count)]]


def memory_fraction(*, need_bytes: int, total_bytes: int) -> float:
    """The share of the slot's memory the replica may use, as the load message carries it."""
    if total_bytes <= 0:
        return 1.0
    return round(min(1.0, max(0.01, need_bytes / total_bytes)), 4)
