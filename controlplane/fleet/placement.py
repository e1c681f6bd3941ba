"""Placement and scale-down choices, as pure functions over a snapshot of the fleet (no ORM), so
the rules can be read and tested on their own; reconcile feeds them and acts on the result."""

from collections import Counter
from dataclasses import dataclass
from datetime import datetime

from controlplane.common.units import human_bytes
from gpuworker.contract.placement import gpu_share_bytes


@dataclass
class Slot:
    """Somewhere a replica can run: one GPU of a worker, or a CPU-only worker's memory."""

    worker_id: int
    gpu_id: int | None
    gpu_index: int | None
    total_bytes: int
    used_bytes: int
    # Why no replica may go here whatever its free memory, e.g. "measuring the quality of smol":
    # a process of its own holds the GPU, and a replica beside it would share its memory.
    taken_by: str = ""

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes


def held_gpu_indexes(*, first_index: int | None, tensor_parallel_size: int) -> list[int]:
    """The GPUs a replica holds: tensor_parallel_size GPUs from its first, as the worker's
    supervisor starts rank r on GPU first_index + r; none for a replica on a worker's CPU."""
    return [] if first_index is None else list(range(first_index, first_index + tensor_parallel_size))


def held_places(*, first_index: int | None, tensor_parallel_size: int) -> list[int | None]:
    """The places a replica's memory is counted at, as placement slots know them: its GPU indexes,
    or [None] (its worker's CPU memory) for a replica on a CPU worker."""
    return held_gpu_indexes(first_index=first_index, tensor_parallel_size=tensor_parallel_size) or [None]


def share_bytes(*, need_bytes: int, on_gpu: bool, tensor_parallel_size: int) -> int:
    """What a replica of `need_bytes` needs on one place it holds: its share on a GPU, all of it on
    a CPU worker (whose ranks share the host's memory)."""
    if not on_gpu:
        return need_bytes
    return gpu_share_bytes(need_bytes=need_bytes, tensor_parallel_size=tensor_parallel_size)


def slot_groups(slots: list[Slot], tensor_parallel_size: int) -> list[tuple[Slot, ...]]:
    """Where one replica split over tensor_parallel_size GPUs can go: each run of that many GPUs
    of one worker with consecutive indexes (a GPU not present breaks the run), and each CPU-only
    worker's memory. For one GPU: each slot on its own."""
    groups = []
    by_worker: dict[int, dict[int, Slot]] = {}
    for slot in slots:
        if slot.gpu_index is None:
            groups.append((slot,))
        else:
            by_worker.setdefault(slot.worker_id, {})[slot.gpu_index] = slot
    for gpus in by_worker.values():
        for first in sorted(gpus):
            run = [gpus.get(first + r) for r in range(tensor_parallel_size)]
            if None not in run:
                groups.append(tuple(run))
    return groups


def group_fits(group: tuple[Slot, ...], *, need_bytes: int, tensor_parallel_size: int) -> bool:
    return all(
        not slot.taken_by
        and slot.free_bytes
        >= share_bytes(need_bytes=need_bytes, on_gpu=slot.gpu_id is not None, tensor_parallel_size=tensor_parallel_size)
        for slot in group
    )


def largest_replica_bytes(*, slots: list[Slot], tensor_parallel_size: int) -> int | None:
    """The largest replica these slots could hold if they were empty (capacity, not free room)."""
    sizes = [
        min(slot.total_bytes for slot in group) * (1 if group[0].gpu_id is None else tensor_parallel_size)
        for group in slot_groups(slots, tensor_parallel_size)
    ]
    return max(sizes, default=None)


def plan_placements(
    *,
    slots: list[Slot],
    need_bytes: int,
    count: int,
    replicas_per_worker: Counter,
    replicas_per_slot: Counter,
    failures_per_worker: Counter | None = None,
    tensor_parallel_size: int = 1,
) -> list[tuple[Slot, ...]]:
    """Up to `count` places for new replicas of one deployment: each a group of slots
    (slot_groups) with the replica's share of `need_bytes` free on every one. Its first slot is
    where the replica is recorded and the load starts (gpu_index).

    A deployment is spread across workers first, then away from workers where its load failed
    lately (`failures_per_worker`: a retry there comes after the others), then across GPUs (a host
    going away should take as few of its replicas as possible; `replicas_per_slot` counts them by
    (worker id, GPU index), None for the CPU), then onto the emptiest GPUs, which leaves room for
    the KV cache to grow. Fewer than `count` come back when the fleet has no more room.
    """
    failures = failures_per_worker or Counter()
    per_worker, per_slot = Counter(replicas_per_worker), Counter(replicas_per_slot)
    groups = slot_groups(slots, tensor_parallel_size)
    chosen = []
    for _ in range(count):
        fitting = [g for g in groups if group_fits(g, need_bytes=need_bytes, tensor_parallel_size=tensor_parallel_size)]
        if not fitting:
            break
        group = min(
            fitting,
            key=lambda g: (
                per_worker[g[0].worker_id],
                failures[g[0].worker_id],
                sum(per_slot[(s.worker_id, s.gpu_index)] for s in g),
                -min(s.free_bytes for s in g),
                g[0].worker_id,
                g[0].gpu_index or 0,
            ),
        )
        for slot in group:
            slot.used_bytes += share_bytes(
                need_bytes=need_bytes, on_gpu=slot.gpu_id is not None, tensor_parallel_size=tensor_parallel_size
            )
            per_slot[(slot.worker_id, slot.gpu_index)] += 1
        per_worker[group[0].worker_id] += 1
        chosen.append(group)
    return chosen


def plan_rebalance(
    *,
    slots: list[Slot],
    need_bytes: int,
    replicas_per_worker: Counter,
    replicas_per_slot: Counter,
    tensor_parallel_size: int = 1,
) -> tuple[int, tuple[Slot, ...]] | None:
    """Where one replica of a deployment should move to spread it over workers: (the crowded
    worker, the place on another worker, as plan_placements chooses it), or None.

    The crowded worker holds the most of its replicas (the lowest id among equals), at least two.
    It gives one only to a worker holding at least two fewer, so a move never just swaps which
    worker holds more (two on A and one on B stay, and a lone replica never moves). `slots` are
    the places that may take it, with what is free now beside the replicas that stay.
    """
    if not replicas_per_worker:
        return None
    crowded, most = min(replicas_per_worker.items(), key=lambda item: (-item[1], item[0]))
    if most < 2:
        return None
    open_slots = [slot for slot in slots if replicas_per_worker[slot.worker_id] <= most - 2]
    chosen = plan_placements(
        slots=open_slots,
        need_bytes=need_bytes,
        count=1,
        replicas_per_worker=replicas_per_worker,
        replicas_per_slot=replicas_per_slot,
        tensor_parallel_size=tensor_parallel_size,
    )
    return (crowded, chosen[0]) if chosen else None


@dataclass(frozen=True)
class SlotRoom:
    """One place a replica could have gone, as a person reads it: "worker-a GPU 0 (H200)", its
    free and total memory, and why it was passed over if not for room (a backoff, say)."""

    label: str
    free_bytes: int
    total_bytes: int
    note: str = ""


def room_message(*, need_bytes: int, rooms: list[SlotRoom], tensor_parallel_size: int = 1) -> str:
    """What a replica needs and what each place has free, in human units, e.g. "needs 9.6 GiB;
    free: worker-a GPU 0 (H200) 19.0 GiB of 140.0 GiB but backing off until 12:03:10 after 2
    failed loads; worker-b GPU 1 (H200) 2.1 GiB of 140.0 GiB". Split over N GPUs: "needs 4.8 GiB
    on each of 2 GPUs of one worker (9.6 GiB in all); free: ..."."""
    need = human_bytes(need_bytes)
    if tensor_parallel_size > 1:
        share = human_bytes(gpu_share_bytes(need_bytes=need_bytes, tensor_parallel_size=tensor_parallel_size))
        need = f"{share} on each of {tensor_parallel_size} GPUs of one worker ({need} in all)"
    if not rooms:
        return f"needs {need}; no online worker to place it on"
    parts = []
    for room in rooms:
        text = f"{room.label} {human_bytes(max(0, room.free_bytes))} of {human_bytes(room.total_bytes)}"
        parts.append(f"{text} but {room.note}" if room.note else text)
    return f"needs {need}; free: " + "; ".join(parts)


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
    ordered = sorted(
        candidates,
        key=lambda c: (
            _REMOVE_FIRST.get(c.state, 3),
            c.outstanding_requests,
            -c.created_at.timestamp(),
            -c.replica_id,
        ),
    )
    return [c.replica_id for c in ordered[: max(0, count)]]


def memory_fraction(*, need_bytes: int, total_bytes: int) -> float:
    """The share of the slot's memory the replica may use, as the load message carries it."""
    if total_bytes <= 0:
        return 1.0
    return round(min(1.0, max(0.01, need_bytes / total_bytes)), 4)
