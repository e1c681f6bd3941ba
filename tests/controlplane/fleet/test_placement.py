from collections import Counter
from datetime import datetime, timedelta, timezone

from controlplane.fleet.placement import (
    Candidate,
    Slot,
    SlotRoom,
    choose_to_remove,
    held_gpu_indexes,
    held_places,
    largest_replica_bytes,
    memory_fraction,
    plan_placements,
    plan_rebalance,
    room_message,
)

GB = 1024**3


def _slots():
    return [
        Slot(worker_id=1, gpu_id=10, gpu_index=0, total_bytes=80 * GB, used_bytes=70 * GB),
        Slot(worker_id=1, gpu_id=11, gpu_index=1, total_bytes=80 * GB, used_bytes=10 * GB),
        Slot(worker_id=2, gpu_id=20, gpu_index=0, total_bytes=80 * GB, used_bytes=40 * GB),
    ]


def test_places_on_the_emptiest_gpu_that_fits():
    chosen = plan_placements(
        slots=_slots(), need_bytes=20 * GB, count=1, replicas_per_worker=Counter(), replicas_per_slot=Counter()
    )
    assert [(s.worker_id, s.gpu_id) for (s,) in chosen] == [(1, 11)]


def test_spreads_a_deployment_across_workers_before_packing_one():
    chosen = plan_placements(
        slots=_slots(), need_bytes=20 * GB, count=2, replicas_per_worker=Counter(), replicas_per_slot=Counter()
    )
    assert sorted(s.worker_id for (s,) in chosen) == [1, 2]
    # A replica already on worker 1 sends the next one to worker 2 even though worker 1 has more room.
    chosen = plan_placements(
        slots=_slots(),
        need_bytes=20 * GB,
        count=1,
        replicas_per_worker=Counter({1: 1}),
        replicas_per_slot=Counter({(1, 1): 1}),
    )
    assert [s.worker_id for (s,) in chosen] == [2]


def test_counts_what_it_placed_and_stops_when_nothing_fits():
    chosen = plan_placements(
        slots=_slots(), need_bytes=35 * GB, count=5, replicas_per_worker=Counter(), replicas_per_slot=Counter()
    )
    # GPU 11 has 70 GB free (two fit), GPU 20 has 40 (one), GPU 10 has 10 (none).
    assert Counter(s.gpu_id for (s,) in chosen) == Counter({11: 2, 20: 1})


def test_cpu_slots_have_no_gpu():
    cpu = Slot(worker_id=3, gpu_id=None, gpu_index=None, total_bytes=8 * GB, used_bytes=0)
    assert plan_placements(
        slots=[cpu], need_bytes=GB, count=1, replicas_per_worker=Counter(), replicas_per_slot=Counter()
    ) == [(cpu,)]


def test_scale_down_removes_unserving_then_idle_then_newest():
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    candidates = [
        Candidate(1, "ready", t0, outstanding_requests=5),
        Candidate(2, "ready", t0 + timedelta(minutes=1), outstanding_requests=0),
        Candidate(3, "ready", t0 + timedelta(minutes=2), outstanding_requests=0),
        Candidate(4, "loading", t0, outstanding_requests=0),
        Candidate(5, "pending", t0, outstanding_requests=0),
    ]
    assert choose_to_remove(candidates=candidates, count=4) == [5, 4, 3, 2]
    assert choose_to_remove(candidates=candidates, count=0) == []


def test_memory_fraction_is_bounded():
    assert memory_fraction(need_bytes=20 * GB, total_bytes=80 * GB) == 0.25
    assert memory_fraction(need_bytes=1, total_bytes=80 * GB) == 0.01
    assert memory_fraction(need_bytes=100 * GB, total_bytes=80 * GB) == 1.0


def test_a_worker_where_the_model_failed_comes_after_the_others():
    # Worker 1 has the emptiest GPU, but the model failed there lately: worker 2 first.
    chosen = plan_placements(
        slots=_slots(),
        need_bytes=20 * GB,
        count=1,
        replicas_per_worker=Counter(),
        replicas_per_slot=Counter(),
        failures_per_worker=Counter({1: 1}),
    )
    assert [s.worker_id for (s,) in chosen] == [2]
    # It is still used when nothing else fits.
    chosen = plan_placements(
        slots=_slots(),
        need_bytes=50 * GB,
        count=1,
        replicas_per_worker=Counter(),
        replicas_per_slot=Counter(),
        failures_per_worker=Counter({1: 3}),
    )
    assert [(s.worker_id, s.gpu_id) for (s,) in chosen] == [(1, 11)]


def test_the_room_message_says_what_was_needed_and_free_per_gpu():
    rooms = [
        SlotRoom("worker-a GPU 0 (H200)", 19 * GB, 140 * GB, "backing off until 12:03:10 after 2 failed loads"),
        SlotRoom("worker-b GPU 1 (H200)", int(2.1 * GB), 140 * GB),
        SlotRoom("worker-c CPU", -GB, 8 * GB),
    ]
    assert room_message(need_bytes=9_600_000, rooms=rooms) == (
        "needs 9.2 MiB; free: worker-a GPU 0 (H200) 19.0 GiB of 140.0 GiB but backing off until 12:03:10 after "
        "2 failed loads; worker-b GPU 1 (H200) 2.1 GiB of 140.0 GiB; worker-c CPU 0 B of 8.0 GiB"
    )
    assert room_message(need_bytes=GB, rooms=[]) == "needs 1.0 GiB; no online worker to place it on"


def _gpu(worker_id: int, index: int, free: int, total: int = 80 * GB) -> Slot:
    return Slot(
        worker_id=worker_id, gpu_id=worker_id * 10 + index, gpu_index=index, total_bytes=total, used_bytes=total - free
    )


def _tp2(slots, need=40 * GB, count=1):
    return plan_placements(
        slots=slots,
        need_bytes=need,
        count=count,
        replicas_per_worker=Counter(),
        replicas_per_slot=Counter(),
        tensor_parallel_size=2,
    )


def test_a_replica_split_over_two_gpus_takes_two_consecutive_gpus_of_one_worker_with_its_share_free():
    # Worker 1 has 25 GB free on GPUs 0 and 1: the 40 GB replica puts 20 GB on each. Worker 2's one
    # GPU has 60 GB free: more than the whole replica, but a split replica needs two GPUs.
    slots = [_gpu(1, 0, 25 * GB), _gpu(1, 1, 25 * GB), _gpu(2, 0, 60 * GB)]
    [group] = _tp2(slots)
    assert [(s.worker_id, s.gpu_index) for s in group] == [(1, 0), (1, 1)]
    assert [s.free_bytes for s in slots] == [5 * GB, 5 * GB, 60 * GB]  # the share counted on each GPU
    assert _tp2(slots) == []  # and the next one no longer fits


def test_gpus_with_room_on_two_different_workers_do_not_make_a_place():
    slots = [_gpu(1, 0, 30 * GB), _gpu(1, 1, 5 * GB), _gpu(2, 0, 5 * GB), _gpu(2, 1, 30 * GB)]
    assert _tp2(slots) == []
    # Nor do two GPUs of one worker whose indexes are not consecutive (GPU 1 is not present).
    assert _tp2([_gpu(1, 0, 30 * GB), _gpu(1, 2, 30 * GB)]) == []
    # Two replicas on one four-GPU worker: GPUs 0-1 and 2-3.
    four = [_gpu(1, i, 30 * GB) for i in range(4)]
    assert sorted(tuple(s.gpu_index for s in g) for g in _tp2(four, count=3)) == [(0, 1), (2, 3)]


def test_a_cpu_worker_holds_a_split_replica_whole_in_its_memory():
    cpu = Slot(worker_id=3, gpu_id=None, gpu_index=None, total_bytes=8 * GB, used_bytes=0)
    assert _tp2([cpu], need=6 * GB) == [(cpu,)] and cpu.used_bytes == 6 * GB


def test_the_room_message_of_a_split_replica_says_what_each_gpu_needs_and_has():
    rooms = [SlotRoom("worker-a GPU 0 (H200)", 30 * GB, 140 * GB), SlotRoom("worker-a GPU 1 (H200)", 5 * GB, 140 * GB)]
    assert room_message(need_bytes=40 * GB, rooms=rooms, tensor_parallel_size=2) == (
        "needs 20.0 GiB on each of 2 GPUs of one worker (40.0 GiB in all); free: "
        "worker-a GPU 0 (H200) 30.0 GiB of 140.0 GiB; worker-a GPU 1 (H200) 5.0 GiB of 140.0 GiB"
    )


def test_held_gpus_and_the_largest_replica_a_fleet_can_hold():
    assert held_gpu_indexes(first_index=2, tensor_parallel_size=2) == [2, 3]
    assert held_gpu_indexes(first_index=None, tensor_parallel_size=2) == []
    assert held_places(first_index=2, tensor_parallel_size=2) == [2, 3]
    assert held_places(first_index=None, tensor_parallel_size=2) == [None]
    slots = [_gpu(1, 0, 0, total=80 * GB), _gpu(1, 1, 0, total=40 * GB), _gpu(2, 0, 0, total=140 * GB)]
    assert largest_replica_bytes(slots=slots, tensor_parallel_size=1) == 140 * GB
    assert largest_replica_bytes(slots=slots, tensor_parallel_size=2) == 80 * GB  # 2 × the smaller of worker 1's
    assert largest_replica_bytes(slots=slots, tensor_parallel_size=4) is None


def _worker_slots(*frees_gb):
    return [
        Slot(worker_id=i, gpu_id=10 * i, gpu_index=0, total_bytes=80 * GB, used_bytes=(80 - free) * GB)
        for i, free in enumerate(frees_gb, start=1)
    ]


def test_rebalance_moves_one_from_the_most_crowded_worker_to_one_holding_two_fewer():
    crowded, [slot] = plan_rebalance(
        slots=_worker_slots(40, 40, 40),
        need_bytes=10 * GB,
        replicas_per_worker=Counter({1: 2, 2: 3, 3: 1}),
        replicas_per_slot=Counter({(1, 0): 2, (2, 0): 3, (3, 0): 1}),
    )
    assert (crowded, slot.worker_id) == (2, 3)


def test_rebalance_never_just_swaps_which_worker_holds_more_or_moves_a_lone_replica():
    for per_worker in ({1: 2, 2: 1}, {1: 1}, {1: 1, 2: 1}):
        assert (
            plan_rebalance(
                slots=_worker_slots(40, 40),
                need_bytes=10 * GB,
                replicas_per_worker=Counter(per_worker),
                replicas_per_slot=Counter(),
            )
            is None
        )


def test_rebalance_needs_room_on_the_other_worker():
    args = {"need_bytes": 10 * GB, "replicas_per_worker": Counter({1: 2}), "replicas_per_slot": Counter({(1, 0): 2})}
    assert plan_rebalance(slots=_worker_slots(60, 5), **args) is None
    assert plan_rebalance(slots=_worker_slots(60, 10), **args)[1][0].worker_id == 2
