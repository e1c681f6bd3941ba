from collections import Counter
from datetime import datetime, timedelta, timezone

from controlplane.fleet.placement import Candidate, Slot, choose_to_remove, memory_fraction, plan_placements

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
