import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.catalog.models import Model
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.reconcile import deployment_reconcile, fleet_reconcile
from controlplane.fleet.selectors import deployment_statuses
from controlplane.fleet.services import replica_transition, worker_heartbeat
from gpuworker.contract.heartbeat import parse_heartbeat
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker, queued_tasks

GB = 1024**3
State = Replica.State
URL = "http://127.0.0.1:8101"


def _gpu_worker(memory=80 * GB, **fields):
    return GpuFactory(worker=make_worker(**fields), index=0, memory_total_bytes=memory).worker


def _deployment(desired, memory=10 * GB, **fields):
    return DeploymentFactory(model=ModelFactory(gpu_memory_bytes=memory), desired_replicas=desired,
                             max_replicas=max(desired, 4), **fields)


def _reconcile(deployment):
    return deployment_reconcile(deployment_id=deployment.pk, now=timezone.now())


@pytest.mark.django_db
def test_scale_up_spreads_over_workers_and_sends_each_its_load(django_capture_on_commit_callbacks):
    a, b = _gpu_worker(), _gpu_worker()
    deployment = _deployment(2)
    with django_capture_on_commit_callbacks(execute=True):
        outcome = _reconcile(deployment)
    replicas = Replica.objects.filter(deployment=deployment)
    assert sorted(outcome.placed) == sorted(r.pk for r in replicas) and outcome.unplaced == 0
    assert {r.worker_id for r in replicas} == {a.pk, b.pk}
    for worker in (a, b):
        [(name, kwargs)] = queued_tasks(worker.queue_name)
        assert name == "gpuworker.load_model" and kwargs["gpu_index"] == 0
    # Already at the desired count: a second pass changes nothing.
    assert _reconcile(deployment).placed == []


@pytest.mark.django_db
def test_placement_respects_memory_and_skips_workers_that_take_no_replicas():
    _gpu_worker(memory=15 * GB)
    _gpu_worker(state=Worker.State.DRAINING)
    _gpu_worker(state=Worker.State.LOST)
    first = _deployment(1)
    assert len(_reconcile(first).placed) == 1
    second = _deployment(1)
    assert _reconcile(second).unplaced == 1 and not Replica.objects.filter(deployment=second).exists()
    [status] = deployment_statuses(deployment_ids=[second.pk])
    assert status.state == "waiting" and "bytes free" in status.message


@pytest.mark.django_db
def test_a_cpu_worker_takes_replicas_within_its_memory():
    worker = make_worker(device=Worker.Device.CPU, cpu_memory_total_bytes=3 * GB)
    deployment = _deployment(4, memory=GB)
    outcome = _reconcile(deployment)
    assert len(outcome.placed) == 3 and outcome.unplaced == 1
    assert set(Replica.objects.values_list("worker_id", "gpu_id")) == {(worker.pk, None)}


@pytest.mark.django_db
def test_a_failed_load_is_retried_elsewhere_then_given_up_with_its_reason():
    a, b = _gpu_worker(), _gpu_worker()
    deployment = _deployment(1)
    for _ in range(2):
        [replica_id] = _reconcile(deployment).placed
        replica = Replica.objects.get(pk=replica_id)
        heartbeat = parse_heartbeat({"replicas": [{"replica_id": replica_id, "state": "failed",
                                                   "error": "model path /nope does not exist"}]})
        worker_heartbeat(worker_id=replica.worker_id, heartbeat=heartbeat, now=timezone.now())
    assert set(Replica.objects.values_list("worker_id", "state")) == {(a.pk, State.FAILED), (b.pk, State.FAILED)}
    # Every worker has failed it: no retry loop, and the reason is there for the UI.
    assert _reconcile(deployment).placed == []
    [status] = deployment_statuses(deployment_ids=[deployment.pk])
    assert status.state == "failed" and status.last_error.endswith("model path /nope does not exist")
    # Fixing the model makes every worker eligible again.
    Model.objects.filter(pk=deployment.model_id).update(updated_at=timezone.now() + timedelta(seconds=1))
    assert len(_reconcile(deployment).placed) == 1


@pytest.mark.django_db
def test_scale_down_removes_pending_then_the_least_busy(django_capture_on_commit_callbacks):
    worker = _gpu_worker()
    deployment = _deployment(1)
    busy, idle = (ReplicaFactory(deployment=deployment, worker=worker, state=State.READY, endpoint_url=URL)
                  for _ in range(2))
    pending = ReplicaFactory(deployment=deployment, worker=worker)
    worker_heartbeat(worker_id=worker.pk, now=timezone.now(), heartbeat=parse_heartbeat({"replicas": [
        {"replica_id": busy.pk, "state": "ready", "endpoint_url": URL, "running": 4},
        {"replica_id": idle.pk, "state": "ready", "endpoint_url": URL, "running": 0},
    ]}))
    with django_capture_on_commit_callbacks(execute=True):
        outcome = _reconcile(deployment)
    assert sorted(outcome.removed) == sorted([pending.pk, idle.pk])
    states = dict(Replica.objects.values_list("pk", "state"))
    assert (states[busy.pk], states[idle.pk], states[pending.pk]) == (State.READY, State.DRAINING, State.STOPPED)
    unloads = sorted(kwargs["replica_id"] for name, kwargs in queued_tasks(worker.queue_name)
                     if name == "gpuworker.unload_model")
    assert unloads == sorted([pending.pk, idle.pk])


@pytest.mark.django_db
def test_an_unacknowledged_load_is_failed_and_placed_again(settings):
    settings.FLEET_REPLICA_ACK_TIMEOUT_SECONDS = 30
    worker = _gpu_worker()
    deployment = _deployment(1)
    lost = ReplicaFactory(deployment=deployment, worker=worker)
    Replica.objects.filter(pk=lost.pk).update(state_changed_at=timezone.now() - timedelta(seconds=31))
    fleet_reconcile(now=timezone.now(), deployment_ids=[deployment.pk])
    lost.refresh_from_db()
    assert (lost.state, lost.failure) == (State.FAILED, Replica.Failure.NOT_ACKNOWLEDGED)
    assert "did not acknowledge the load within 30 s" in lost.last_error
    assert Replica.objects.filter(deployment=deployment, state=State.PENDING).count() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_reconciles_never_overfill_a_gpu(require_postgres):
    _gpu_worker(memory=15 * GB)
    deployments = [_deployment(1) for _ in range(4)]
    barrier = threading.Barrier(len(deployments))
    errors = []

    def run(deployment):
        try:
            barrier.wait()
            _reconcile(deployment)
        except Exception as exc:  # surfaced below; a thread cannot fail the test itself
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(d,)) for d in deployments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    # 10 GB each on a 15 GB GPU: exactly one fits, whichever reconcile got there first.
    assert Replica.objects.count() == 1


@pytest.mark.django_db
def test_statuses_for_the_ui():
    worker = _gpu_worker()
    ready = _deployment(1)
    ReplicaFactory(deployment=ready, worker=worker, state=State.READY, endpoint_url=URL)
    scaling = _deployment(2)
    ReplicaFactory(deployment=scaling, worker=worker, state=State.LOADING)
    stopped = _deployment(0)
    lost = _deployment(1)
    replica = ReplicaFactory(deployment=lost, worker=worker, state=State.READY, endpoint_url=URL)
    replica_transition(replica=replica, to_state=State.FAILED, at=timezone.now(), error="gone",
                       failure=Replica.Failure.WORKER_LOST)
    statuses = {s.deployment_id: s for s in deployment_statuses()}
    assert [statuses[d.pk].state for d in (ready, scaling, stopped, lost)] == ["ready", "scaling", "stopped", "waiting"]
    assert statuses[lost.pk].last_error == f"{worker.name}: gone"
    assert (statuses[scaling.pk].ready, statuses[scaling.pk].starting) == (0, 1)
