from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.fleet import heartbeat_cache
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.selectors import (
    deployment_get_for_model,
    fleet_health,
    gpu_seconds_by_model,
    placement_slots,
    replicas_ready_for_model,
)
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker

pytestmark = pytest.mark.django_db
GB = 1024**3


def test_replicas_ready_for_model_excludes_other_states_models_and_offline_workers():
    deployment = DeploymentFactory()
    ready = ReplicaFactory(deployment=deployment, state=Replica.State.READY, endpoint_url="http://w1:8001")
    ReplicaFactory(deployment=deployment, state=Replica.State.LOADING)
    ReplicaFactory(
        deployment=deployment,
        state=Replica.State.READY,
        endpoint_url="http://w2:8001",
        worker=make_worker(state=Worker.State.OFFLINE),
    )
    ReplicaFactory(state=Replica.State.READY, endpoint_url="http://w3:8001")  # another model
    assert list(replicas_ready_for_model(model=deployment.model)) == [ready]


def test_placement_slots_count_live_replicas_memory_per_gpu():
    gpu = GpuFactory(worker=make_worker(), index=0, memory_total_bytes=80 * GB)
    GpuFactory(worker=gpu.worker, index=1, present=False)
    model = ModelFactory(gpu_memory_bytes=10 * GB)
    for state in (Replica.State.PENDING, Replica.State.DRAINING, Replica.State.FAILED, Replica.State.STOPPED):
        ReplicaFactory(
            deployment=DeploymentFactory(model=ModelFactory(gpu_memory_bytes=10 * GB)),
            worker=gpu.worker,
            gpu=gpu,
            state=state,
        )
    ReplicaFactory(
        deployment=DeploymentFactory(model=model),
        worker=gpu.worker,
        gpu=gpu,
        state=Replica.State.READY,
        endpoint_url="http://w:1",
    )
    cpu = make_worker(device=Worker.Device.CPU, cpu_memory_total_bytes=8 * GB)
    slots = placement_slots(workers=[gpu.worker, cpu])
    # Pending, draining and ready replicas hold memory; failed and stopped ones do not.
    assert [(s.worker_id, s.gpu_index, s.total_bytes, s.used_bytes) for s in slots] == [
        (gpu.worker_id, 0, 80 * GB, 30 * GB),
        (cpu.pk, None, 8 * GB, 0),
    ]


def test_deployment_get_for_model():
    deployment = DeploymentFactory()
    assert deployment_get_for_model(model=deployment.model) == deployment
    assert deployment_get_for_model(model=ModelFactory()) is None


def test_fleet_health_counts_workers_busy_gpus_utilisation_failures_and_models_not_ready():
    now = timezone.now()
    online = make_worker()
    make_worker(state=Worker.State.LOST)
    busy_gpu = GpuFactory(worker=online, index=0)
    GpuFactory(worker=online, index=1)  # idle
    GpuFactory(worker=online, index=2, present=False)  # gone: not counted
    ready = DeploymentFactory(desired_replicas=1)
    ReplicaFactory(deployment=ready, worker=online, gpu=busy_gpu, state=Replica.State.READY, endpoint_url="http://w:1")
    waiting = DeploymentFactory(desired_replicas=1)  # no replica: not ready
    DeploymentFactory(desired_replicas=0)  # stopped on purpose: fine
    failed = ReplicaFactory(deployment=waiting, worker=online, gpu=busy_gpu, state=Replica.State.FAILED)
    Replica.objects.filter(pk=failed.pk).update(state_changed_at=now - timedelta(minutes=5))
    old = ReplicaFactory(deployment=waiting, worker=online, state=Replica.State.FAILED)
    Replica.objects.filter(pk=old.pk).update(state_changed_at=now - timedelta(hours=2))
    heartbeat_cache.store(
        worker_id=online.pk,
        state={
            "worker_id": online.pk,
            "gpus": [{"index": 0, "utilization_pct": 90.0}, {"index": 1, "utilization_pct": 10.0}],
        },
    )

    health = fleet_health(now=now, failures_since=now - timedelta(hours=1))
    assert health.workers_by_state == {"online": 1, "draining": 0, "lost": 1, "offline": 0}
    assert (health.gpus_present, health.gpus_busy, health.gpu_utilisation_pct) == (2, 1, 50.0)
    assert health.replicas_failed_recently == 1
    assert [s.model_name for s in health.not_ready] == [waiting.model.public_name]


def test_fleet_health_without_heartbeats_has_no_utilisation():
    GpuFactory(worker=make_worker())
    now = timezone.now()
    health = fleet_health(now=now, failures_since=now)
    assert (health.gpus_present, health.gpus_busy, health.gpu_utilisation_pct, health.not_ready) == (1, 0, None, [])


def test_a_split_replica_holds_each_of_its_gpus():
    """Its share of memory on each GPU for placement, each GPU busy, and N GPU-seconds a second."""
    worker = make_worker()
    gpus = [GpuFactory(worker=worker, index=i, memory_total_bytes=80 * GB) for i in range(3)]
    model = ModelFactory(gpu_memory_bytes=30 * GB, tensor_parallel_size=2)
    replica = ReplicaFactory(
        deployment=DeploymentFactory(model=model),
        worker=worker,
        gpu=gpus[1],
        tensor_parallel_size=2,
        state=Replica.State.LOADING,
    )
    assert [s.used_bytes for s in placement_slots(workers=[worker])] == [0, 15 * GB, 15 * GB]
    now = timezone.now()
    assert fleet_health(now=now, failures_since=now).gpus_busy == 2
    Replica.objects.filter(pk=replica.pk).update(created_at=now - timedelta(seconds=100))
    seconds = gpu_seconds_by_model(since=now - timedelta(seconds=60), until=now)
    assert seconds == {model.public_name: pytest.approx(120.0)}
