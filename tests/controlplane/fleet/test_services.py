from datetime import timedelta
from itertools import product

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.fleet.models import Gpu, Replica, Worker
from controlplane.fleet.services import (
    GpuSpec,
    replica_create,
    replica_transition,
    worker_record_heartbeat,
    worker_register,
    workers_mark_stale,
)
from controlplane.tokens import secret_hash
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ReplicaFactory, WorkerFactory

pytestmark = pytest.mark.django_db

H200 = 141 * 1024**3
State = Replica.State


def test_worker_register_stores_gpus_and_only_the_token_hash():
    now = timezone.now()
    result = worker_register(
        host="gpu-1", queue_name="worker.gpu-1",
        gpus=[GpuSpec(0, "NVIDIA H200", H200), GpuSpec(1, "NVIDIA H200", H200)], at=now,
    )
    worker = Worker.objects.get(pk=result.worker.pk)
    assert worker.state == Worker.State.ONLINE and worker.last_heartbeat_at == now
    assert [g.index for g in worker.gpus.all()] == [0, 1]
    assert worker.token_hash == secret_hash(result.token)
    assert not any(result.token in str(v) for v in Worker.objects.filter(pk=worker.pk).values().get().values())


def test_worker_register_duplicate_queue_raises_and_writes_nothing():
    worker_register(host="a", queue_name="worker.a", gpus=[], at=timezone.now())
    with pytest.raises(ValidationError) as error:
        worker_register(host="b", queue_name="worker.a", gpus=[GpuSpec(0, "L4", 24 * 1024**3)], at=timezone.now())
    assert "queue_name" in error.value.message_dict
    assert Worker.objects.count() == 1 and Gpu.objects.count() == 0


def test_worker_register_with_a_bad_gpu_writes_no_worker():
    with pytest.raises(ValidationError):
        worker_register(
            host="a", queue_name="worker.a",
            gpus=[GpuSpec(0, "H200", H200), GpuSpec(0, "H200", H200)], at=timezone.now(),
        )
    assert not Worker.objects.exists() and not Gpu.objects.exists()


def test_worker_register_rejects_queue_names_with_spaces():
    with pytest.raises(ValidationError) as error:
        worker_register(host="a", queue_name="worker a", gpus=[], at=timezone.now())
    assert "queue_name" in error.value.message_dict


def test_heartbeat_brings_a_worker_back_online():
    worker = WorkerFactory(state=Worker.State.OFFLINE)
    now = timezone.now()
    worker_record_heartbeat(worker=worker, at=now)
    worker.refresh_from_db()
    assert worker.state == Worker.State.ONLINE and worker.last_heartbeat_at == now


def test_workers_mark_stale_only_touches_silent_workers():
    now = timezone.now()
    silent = WorkerFactory(last_heartbeat_at=now - timedelta(seconds=31))
    fresh = WorkerFactory(last_heartbeat_at=now - timedelta(seconds=5))
    assert workers_mark_stale(now=now, timeout=timedelta(seconds=30)) == 1
    silent.refresh_from_db(), fresh.refresh_from_db()
    assert silent.state == Worker.State.OFFLINE and fresh.state == Worker.State.ONLINE


def test_replica_create_on_a_gpu_of_its_worker():
    gpu = GpuFactory()
    replica = replica_create(deployment=DeploymentFactory(), worker=gpu.worker, gpu=gpu)
    assert replica.state == State.PENDING


def test_replica_on_another_workers_gpu_raises_and_writes_nothing():
    with pytest.raises(ValidationError) as error:
        replica_create(deployment=DeploymentFactory(), worker=WorkerFactory(), gpu=GpuFactory())
    assert "gpu" in error.value.message_dict
    assert not Replica.objects.exists()


def test_replica_lifecycle_through_every_normal_state():
    replica = ReplicaFactory()
    replica = replica_transition(replica=replica, to_state=State.LOADING, at=timezone.now())
    replica = replica_transition(
        replica=replica, to_state=State.READY, at=timezone.now(), endpoint_url="http://gpuworker:8001"
    )
    replica = replica_transition(replica=replica, to_state=State.DRAINING, at=timezone.now())
    replica = replica_transition(replica=replica, to_state=State.STOPPED, at=timezone.now())
    stored = Replica.objects.get(pk=replica.pk)
    assert stored.state == State.STOPPED and stored.endpoint_url == "http://gpuworker:8001"


LEGAL = {(src, dst) for src, targets in Replica.TRANSITIONS.items() for dst in targets}
ILLEGAL = sorted(set(product(State.values, State.values)) - LEGAL)


def test_the_state_machine_matches_the_documented_lifecycle():
    assert LEGAL == {
        ("pending", "loading"), ("pending", "stopped"), ("pending", "failed"),
        ("loading", "ready"), ("loading", "draining"), ("loading", "failed"),
        ("ready", "draining"), ("ready", "failed"),
        ("draining", "stopped"), ("draining", "failed"),
    }


@pytest.mark.parametrize(("src", "dst"), ILLEGAL, ids=[f"{s}->{d}" for s, d in ILLEGAL])
def test_illegal_transitions_raise_and_leave_the_replica_alone(src, dst):
    replica = ReplicaFactory(state=src, endpoint_url="http://gpuworker:8001")
    changed_at = replica.state_changed_at
    with pytest.raises(ValidationError) as error:
        replica_transition(replica=replica, to_state=dst, at=timezone.now(), endpoint_url="http://x:1")
    assert f"from {src} to {dst}" in str(error.value.message_dict["state"])
    stored = Replica.objects.get(pk=replica.pk)
    assert (stored.state, stored.state_changed_at, stored.endpoint_url) == (src, changed_at, "http://gpuworker:8001")


def test_unknown_target_state_raises():
    replica = ReplicaFactory()
    with pytest.raises(ValidationError, match="Unknown replica state"):
        replica_transition(replica=replica, to_state="sleeping", at=timezone.now())


def test_ready_needs_an_endpoint_url():
    replica = ReplicaFactory(state=State.LOADING)
    with pytest.raises(ValidationError) as error:
        replica_transition(replica=replica, to_state=State.READY, at=timezone.now())
    assert "endpoint_url" in error.value.message_dict
    assert Replica.objects.get(pk=replica.pk).state == State.LOADING


@pytest.mark.parametrize("url", ["gpuworker:8001", "ftp://gpuworker/", "http://"])
def test_bad_endpoint_urls_raise(url):
    replica = ReplicaFactory(state=State.LOADING)
    with pytest.raises(ValidationError) as error:
        replica_transition(replica=replica, to_state=State.READY, at=timezone.now(), endpoint_url=url)
    assert "endpoint_url" in error.value.message_dict
    assert Replica.objects.get(pk=replica.pk).state == State.LOADING


def test_failed_records_the_error():
    replica = ReplicaFactory(state=State.LOADING)
    replica_transition(replica=replica, to_state=State.FAILED, at=timezone.now(), error="CUDA out of memory")
    stored = Replica.objects.get(pk=replica.pk)
    assert stored.state == State.FAILED and stored.last_error == "CUDA out of memory"
