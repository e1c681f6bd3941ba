from collections import Counter
from datetime import datetime, timedelta, timezone

from controlplane.fleet.placement import (
    Candidate,
    Slot,
    SlotRoom,
    choose_to_remove,
    memory_fraction,
    plan_placements,
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
    chosen = plan_placements(slots=_slots(), need_bytes=20 * GB, count=1,
                             replicas_per_worker=Counter(), replicas_per_slot=Counter())
    assert [(s.worker_id, s.gpu_id) for s in chosen] == [(1, 11)]


def test_spreads_a_deployment_across_workers_before_packing_one():
    chosen = plan_placements(slots=_slots(), need_bytes=20 * GB, count=2,
                             replicas_per_worker=Counter(), replicas_per_slot=Counter())
    assert sorted(s.worker_id for s in chosen) == [1, 2]
    # A replica already on worker 1 sends the next one to worker 2 even though worker 1 has more room.
    chosen = plan_placements(slots=_slots(), need_bytes=20 * GB, count=1,
                             replicas_per_worker=Counter({1: 1}), replicas_per_slot=Counter({(1, 11): 1}))
    assert [s.worker_id for s in chosen] == [2]


def test_counts_what_it_placed_and_stops_when_nothing_fits():
    chosen = plan_placements(slots=_slots(), need_bytes=35 * GB, count=5,
                             replicas_per_worker=Counter(), replicas_per_slot=Counter())
    # GPU 11 has 70 GB free (two fit), GPU 20 has 40 (one), GPU 10 has 10 (none).
    assert Counter(s.gpu_id for s in chosen) == Counter({11: 2, 20: 1})


def test_cpu_slots_have_no_gpu():
    cpu = Slot(worker_id=3, gpu_id=None, gpu_index=None, total_bytes=8 * GB, used_bytes=0)
    assert plan_placements(slots=[cpu], need_bytes=GB, count=1, replicas_per_worker=Counter(),
                           replicas_per_slot=Counter()) == [cpu]


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
    chosen = plan_placements(slots=_slots(), need_bytes=20 * GB, count=1, replicas_per_worker=Counter(),
                             replicas_per_slot=Counter(), failures_per_worker=Counter({1: 1}))
    assert [s.worker_id for s in chosen] == [2]
    # It is still used when nothing else fits.
    chosen = plan_placements(slots=_slots(), need_bytes=50 * GB, count=1, replicas_per_worker=Counter(),
                             replicas_per_slot=Counter(), failures_per_worker=Counter({1: 3}))
    assert [(s.worker_id, s.gpu_id) for s in chosen] == [(1, 11)]


def test_the_room_message_says_what_was_needed_and_free_per_gpu():
    rooms = [SlotRoom("worker-a GPU 0 (H200)", 19 * GB, 140 * GB, "backing off until 12:03:10 after 2 failed loads"),
             SlotRoom("worker-b GPU 1 (H200)", int(2.1 * GB), 140 * GB),
             SlotRoom("worker-c CPU", -GB, 8 * GB)]
    assert room_message(need_bytes=9_600_000, rooms=rooms) == (
        "needs 9.2 MiB; free: worker-a GPU 0 (H200) 19.0 GiB of 140.0 GiB but backing off until 12:03:10 after "
        "2 failed loads; worker-b GPU 1 (H200) 2.1 GiB of 140.0 GiB; worker-c CPU 0 B of 8.0 GiB")
    assert room_message(need_bytes=GB, rooms=[]) == "needs 1.0 GiB; no online worker to place it on"
