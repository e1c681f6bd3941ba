"""Placement and scale-down choices, as pure functions over a snapshot of the fleet (no ORM), so
the rules can be read and tested on their own; reconcile feeds them and acts on the result."""

from collections import Counter
from dataclasses import dataclass
from datetime import datetime

from controlplane.common.units import human_bytes


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
    replicas_per_worker: Counter, replicas_per_slot: Counter, failures_per_worker: Counter | None = None,
) -> list[Slot]:
    """Up to `count` slots for new replicas of one deployment, each with `need_bytes` free.

    A deployment is spread across workers first, then away from workers where its load failed
    lately (`failures_per_worker`: a retry there comes after the others), then across GPUs (a host
    going away should take as few of its replicas as possible), then onto the emptiest GPU, which
    leaves room for the KV cache to grow. Fewer than `count` come back when the fleet has no more room.
    """
    failures = failures_per_worker or Counter()
    per_worker, per_slot = Counter(replicas_per_worker), Counter(replicas_per_slot)
    chosen = []
    for _ in range(count):
        fitting = [slot for slot in slots if slot.free_bytes >= need_bytes]
        if not fitting:
            break
        slot = min(fitting, key=lambda s: (
            per_worker[s.worker_id], failures[s.worker_id], per_slot[(s.worker_id, s.gpu_id)], -s.free_bytes, s.worker_id, s.gpu_index or 0,
        ))
        slot.used_bytes += need_bytes
        per_worker[slot.worker_id] += 1
        per_slot[(slot.worker_id, slot.gpu_id)] += 1
        chosen.append(slot)
    return chosen


@dataclass(frozen=True)
class SlotRoom:
    """One place a replica could have gone, as a person reads it: "worker-a GPU 0 (H200)", its
    free and total memory, and why it was passed over if not for room (a backoff, say)."""

    label: str
    free_bytes: int
    total_bytes: int
    note: str = ""


def room_message(*, need_bytes: int, rooms: list[SlotRoom]) -> str:
    """What a replica needs and what each place has free, in human units, e.g. "needs 9.6 GiB;
    free: worker-a GPU 0 (H200) 19.0 GiB of 140.0 GiB but backing off until 12:03:10 after 2
    failed loads; worker-b GPU 1 (H200) 2.1 GiB of 140.0 GiB"."""
    if not rooms:
        return f"needs {human_bytes(need_bytes)}; no online worker to place it on"
    parts = []
    for room in rooms:
        text = f"{room.label} {human_bytes(max(0, room.free_bytes))} of {human_bytes(room.total_bytes)}"
        parts.append(f"{text} but {room.note}" if room.note else text)
    return f"needs {human_bytes(need_bytes)}; free: " + "; ".join(parts)


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
