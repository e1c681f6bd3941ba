"""Rebalancing in the control loop: a deployment's replicas crowded on one worker are spread again,
make-before-break, when another worker can hold one."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.fleet.models import LoadBackoff, RebalanceMove, Replica, Worker
from controlplane.fleet.reconcile import fleet_reconcile
from controlplane.fleet.selectors import deployment_statuses
from controlplane.fleet.services.heartbeats import worker_heartbeat
from gpuworker.contract.heartbeat import parse_heartbeat
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory
from tests.controlplane.fleet.conftest import make_worker, queued_tasks

GB = 1024**3
State = Replica.State


def _gpu_worker(memory=80 * GB, **fields):
    return GpuFactory(worker=make_worker(**fields), index=0, memory_total_bytes=memory).worker


def _report(worker, at, **states):
    """One heartbeat of `worker` reporting its replicas (`r<id>="ready"`), as its daemon sends it."""
    replicas = [
        {"replica_id": int(key[1:]), "state": state, "endpoint_url": f"http://127.0.0.1:{9000 + int(key[1:])}"}
        for key, state in states.items()
    ]
    worker_heartbeat(worker_id=worker.pk, now=at, heartbeat=parse_heartbeat({"replicas": replicas}))


def _pass(deployment, at):
    [outcome] = fleet_reconcile(now=at, deployment_ids=[deployment.pk])
    return outcome


def _replicas(deployment, worker, *states):
    return list(Replica.objects.filter(deployment=deployment, worker=worker, state__in=states).order_by("pk"))


@pytest.fixture
def crowded(settings, django_capture_on_commit_callbacks):
    """Two ready replicas of a deployment on worker A, placed while B was away, and B back online.
    Returns (deployment, a, b, now); the load and unload messages reach the real broker."""
    settings.FLEET_REBALANCE_COOLDOWN_SECONDS = 60

    def build(desired=2, b_memory=80 * GB, memory=10 * GB):
        a = _gpu_worker()
        b = _gpu_worker(memory=b_memory, state=Worker.State.LOST)
        deployment = DeploymentFactory(
            model=ModelFactory(gpu_memory_bytes=memory), desired_replicas=desired, max_replicas=4
        )
        now = timezone.now()
        with django_capture_on_commit_callbacks(execute=True):
            assert len(_pass(deployment, now).placed) == desired
        _report(a, now, **{f"r{r.pk}": "ready" for r in _replicas(deployment, a, State.PENDING)})
        assert len(_replicas(deployment, a, State.READY)) == desired
        queued_tasks(a.queue_name)  # the loads it was sent
        Worker.objects.filter(pk=b.pk).update(state=Worker.State.ONLINE)
        return deployment, a, b, now

    return build


@pytest.mark.django_db
def test_a_replica_moves_to_the_returning_worker_before_the_crowded_one_lets_one_go(
    crowded, django_capture_on_commit_callbacks
):
    deployment, a, b, now = crowded()
    first, second = _replicas(deployment, a, State.READY)
    with django_capture_on_commit_callbacks(execute=True):
        outcome = _pass(deployment, now + timedelta(seconds=1))
    [new] = _replicas(deployment, b, State.PENDING)
    assert outcome.placed == [new.pk] and outcome.removed == []
    [(name, kwargs)] = queued_tasks(b.queue_name)
    assert name == "gpuworker.load_model" and kwargs["replica_id"] == new.pk
    # Make before break: both of A's replicas keep serving, nothing is sent to A.
    assert len(_replicas(deployment, a, State.READY)) == 2 and queued_tasks(a.queue_name) == []
    [status] = deployment_statuses(deployment_ids=[deployment.pk])
    assert f"Moving a replica from {a.name} to {b.name}" in status.message

    # While it loads, no second move starts and scale-down does not take the extra one.
    _report(b, now + timedelta(seconds=2), **{f"r{new.pk}": "loading"})
    with django_capture_on_commit_callbacks(execute=True):
        outcome = _pass(deployment, now + timedelta(seconds=3))
    assert (outcome.placed, outcome.removed) == ([], [])
    assert queued_tasks(a.queue_name) == [] and queued_tasks(b.queue_name) == []

    _report(b, now + timedelta(seconds=4), **{f"r{new.pk}": "ready"})
    with django_capture_on_commit_callbacks(execute=True):
        outcome = _pass(deployment, now + timedelta(seconds=5))
    [drained] = _replicas(deployment, a, State.DRAINING)
    assert outcome.removed == [drained.pk] and drained.pk in (first.pk, second.pk)
    [(name, kwargs)] = queued_tasks(a.queue_name)
    assert name == "gpuworker.unload_model" and kwargs["replica_id"] == drained.pk
    assert {r.worker_id for r in Replica.objects.filter(deployment=deployment, state=State.READY)} == {a.pk, b.pk}
    move = RebalanceMove.objects.get(deployment=deployment)
    assert (move.state, move.replica_id, move.drained_replica_id) == (RebalanceMove.State.MOVED, new.pk, drained.pk)
    audited = AuditEntry.objects.filter(action=AuditEntry.Action.REPLICA_MOVE).order_by("pk")
    assert [e.detail["state"] for e in audited] == ["moving", "moved"]
    assert audited[0].detail["replicas_per_worker"] == {a.name: 2} and audited[0].actor_label == "system"
    # Spread now: the drained replica stopping changes nothing more.
    _report(a, now + timedelta(seconds=6), **{f"r{r.pk}": "ready" for r in _replicas(deployment, a, State.READY)})
    assert _pass(deployment, now + timedelta(seconds=120)).placed == []


@pytest.mark.django_db
def test_no_move_when_the_other_worker_has_no_room(crowded):
    deployment, a, b, now = crowded(b_memory=5 * GB)
    assert _pass(deployment, now + timedelta(seconds=1)).placed == []
    assert not Replica.objects.filter(worker=b).exists() and queued_tasks(b.queue_name) == []


@pytest.mark.django_db
def test_no_move_for_a_deployment_of_one_replica(crowded):
    deployment, a, b, now = crowded(desired=1)
    assert _pass(deployment, now + timedelta(seconds=1)).placed == []
    assert not RebalanceMove.objects.exists() and queued_tasks(b.queue_name) == []


@pytest.mark.django_db
def test_no_move_while_the_deployment_scales_or_backs_off(crowded):
    deployment, a, b, now = crowded()
    # Scaling up: the third replica goes to B as an ordinary placement, and no move starts beside it.
    deployment.desired_replicas = 3
    deployment.save()
    outcome = _pass(deployment, now + timedelta(seconds=1))
    assert len(outcome.placed) == 1 and not RebalanceMove.objects.exists()
    Replica.objects.filter(deployment=deployment, worker=b).delete()
    deployment.desired_replicas = 2
    deployment.save()
    # A load of it backing off on some worker holds moves back until the wait is over.
    LoadBackoff.objects.create(
        deployment=deployment,
        worker=_gpu_worker(state=Worker.State.OFFLINE),
        consecutive_failures=1,
        first_failed_at=now,
        last_failed_at=now,
        next_attempt_at=now + timedelta(seconds=30),
    )
    assert _pass(deployment, now + timedelta(seconds=2)).placed == []
    assert len(_pass(deployment, now + timedelta(seconds=31)).placed) == 1


@pytest.mark.django_db
def test_a_failed_replacement_leaves_the_crowded_worker_its_replicas_and_cools_down(
    crowded, django_capture_on_commit_callbacks
):
    deployment, a, b, now = crowded()
    with django_capture_on_commit_callbacks(execute=True):
        [new_id] = _pass(deployment, now + timedelta(seconds=1)).placed
    queued_tasks(b.queue_name)
    _report(b, now + timedelta(seconds=2), **{f"r{new_id}": "failed"})
    with django_capture_on_commit_callbacks(execute=True):
        outcome = _pass(deployment, now + timedelta(seconds=3))
    assert (outcome.placed, outcome.removed) == ([], [])
    assert len(_replicas(deployment, a, State.READY)) == 2 and queued_tasks(a.queue_name) == []
    assert RebalanceMove.objects.get(deployment=deployment).state == RebalanceMove.State.FAILED
    # B's backoff (10 s) is over but the cooldown (60 s) is not: no second try yet; after it, one.
    assert _pass(deployment, now + timedelta(seconds=30)).placed == []
    assert len(_pass(deployment, now + timedelta(seconds=64)).placed) == 1


@pytest.mark.django_db
def test_a_second_move_waits_for_the_cooldown(crowded, django_capture_on_commit_callbacks):
    deployment, a, b, now = crowded(desired=4)
    c = _gpu_worker()
    # Four on A, two empty workers: one move at a time, the next after the cooldown.
    [first_id] = _pass(deployment, now + timedelta(seconds=1)).placed
    assert _pass(deployment, now + timedelta(seconds=2)).placed == []
    first = Replica.objects.get(pk=first_id)
    _report(first.worker, now + timedelta(seconds=3), **{f"r{first_id}": "ready"})
    [drained] = _pass(deployment, now + timedelta(seconds=4)).removed
    _report(a, now + timedelta(seconds=5), **{f"r{r.pk}": "ready" for r in _replicas(deployment, a, State.READY)})
    assert Replica.objects.get(pk=drained).state == State.STOPPED
    assert _pass(deployment, now + timedelta(seconds=30)).placed == []
    [second_id] = _pass(deployment, now + timedelta(seconds=65)).placed
    assert {first.worker_id, Replica.objects.get(pk=second_id).worker_id} == {b.pk, c.pk}
    for worker in (a, b, c):
        queued_tasks(worker.queue_name)


@pytest.mark.django_db
def test_the_extra_replica_stays_while_the_ready_ones_would_fall_below_desired(
    crowded, django_capture_on_commit_callbacks
):
    deployment, a, b, now = crowded(desired=3)
    c = _gpu_worker()
    [new_id] = _pass(deployment, now + timedelta(seconds=1)).placed
    new = Replica.objects.get(pk=new_id)
    # A replica on A crashes while the replacement loads; the replacement then gets ready.
    keep, *_ = _replicas(deployment, a, State.READY)
    _report(a, now + timedelta(seconds=2), **{f"r{r.pk}": "ready" for r in _replicas(deployment, a, State.READY)[1:]})
    assert Replica.objects.get(pk=keep.pk).state == State.FAILED
    _report(new.worker, now + timedelta(seconds=3), **{f"r{new_id}": "ready"})
    # Three ready of three wanted (two on A): draining one now would leave two, so none drains.
    outcome = _pass(deployment, now + timedelta(seconds=4))
    assert outcome.removed == [] and not Replica.objects.filter(deployment=deployment, state=State.DRAINING).exists()
    assert len(outcome.placed) == 1  # the crashed one's replacement, as ever
    for worker in (a, b, c):
        queued_tasks(worker.queue_name)


@pytest.mark.django_db
def test_a_move_is_abandoned_when_the_crowded_worker_loses_its_replicas(crowded):
    deployment, a, b, now = crowded()
    [new_id] = _pass(deployment, now + timedelta(seconds=1)).placed
    _report(a, now + timedelta(seconds=2), **{f"r{r.pk}": "failed" for r in _replicas(deployment, a, State.READY)})
    # The replacement is an ordinary replica now, and the one still missing is placed as ever.
    outcome = _pass(deployment, now + timedelta(seconds=3))
    assert RebalanceMove.objects.get(deployment=deployment).state == RebalanceMove.State.ABANDONED
    assert len(outcome.placed) == 1 and Replica.objects.get(pk=new_id).state == State.PENDING
    for worker in (a, b):
        queued_tasks(worker.queue_name)
