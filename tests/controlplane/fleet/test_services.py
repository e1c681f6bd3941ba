from itertools import product

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import Deployment
from controlplane.catalog.services import estimate_gpu_memory_bytes
from controlplane.celery import app as celery_app
from controlplane.fleet.models import Gpu, LoadBackoff, QualityMeasurement, Replica, Worker
from controlplane.fleet.reconcile import deployment_reconcile
from controlplane.fleet.selectors import worker_latest_heartbeat
from controlplane.fleet.services.deployments import (
    deployment_create,
    deployment_retry_loads,
    deployment_scale,
    deployment_wake,
)
from controlplane.fleet.services.heartbeats import worker_heartbeat
from controlplane.fleet.services.replicas import replica_load_on, replica_place, replica_transition, replica_unload
from controlplane.fleet.services.workers import WorkerUnknown, worker_drain, worker_register
from gpuworker.contract.heartbeat import parse_heartbeat, parse_registration
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker, queued_tasks

pytestmark = pytest.mark.django_db

H200 = 141 * 1024**3
GB = 1024**3
State = Replica.State
URL = "http://127.0.0.1:8101"


def _registration(name="host-a", gpus=((0, H200),), device="cuda"):
    return parse_registration(
        {
            "name": name,
            "advertise_host": "10.0.0.5",
            "device": device,
            "gpus": [{"index": i, "name": "NVIDIA H200", "memory_total_bytes": m} for i, m in gpus],
            "cpu": {"memory_total_bytes": 256 * GB, "cores": 32},
            "version": "0.1.0",
        }
    )


def _beat(worker, *replicas, draining=False, now=None):
    heartbeat = parse_heartbeat(
        {
            "draining": draining,
            "replicas": list(replicas),
            "gpus": [{"index": 0, "utilization_pct": 50.0}],
            "cpu": {"utilization_pct": 3.0},
        }
    )
    return worker_heartbeat(worker_id=worker.pk, heartbeat=heartbeat, now=now or timezone.now())


def _state(replica):
    replica.refresh_from_db()
    return replica.state


# --- registration ---------------------------------------------------------------------------


def test_register_creates_the_worker_its_queue_and_gpus(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        worker = worker_register(registration=_registration(gpus=((0, H200), (1, H200))), now=timezone.now())
    assert (worker.queue_name, worker.state, worker.advertise_host) == ("gpuworker.host-a", "online", "10.0.0.5")
    assert [g.index for g in worker.gpus.all()] == [0, 1]
    assert worker_latest_heartbeat(worker_id=worker.pk)["name"] == "host-a"


def test_register_again_updates_the_same_worker_and_retires_missing_gpus():
    first = worker_register(registration=_registration(gpus=((0, H200), (1, H200))), now=timezone.now())
    Worker.objects.filter(pk=first.pk).update(state=Worker.State.LOST)
    again = worker_register(registration=_registration(gpus=((0, 80 * GB),)), now=timezone.now())
    assert again.pk == first.pk and again.state == Worker.State.ONLINE
    gpus = {g.index: g for g in Gpu.objects.filter(worker=again)}
    assert (gpus[0].memory_total_bytes, gpus[0].present, gpus[1].present) == (80 * GB, True, False)


def test_register_rejects_a_name_unfit_for_a_queue():
    with pytest.raises(ValidationError) as error:
        worker_register(registration=_registration(name="host a"), now=timezone.now())
    assert "name" in error.value.message_dict and not Worker.objects.exists()


# --- heartbeats -------------------------------------------------------------------------------


def test_heartbeat_of_an_unknown_worker_raises():
    with pytest.raises(WorkerUnknown):
        worker_heartbeat(worker_id=999_999, heartbeat=parse_heartbeat({}), now=timezone.now())


def test_heartbeat_moves_a_replica_to_ready_and_keeps_figures_in_the_cache():
    replica = ReplicaFactory(worker=make_worker())
    _beat(replica.worker, {"replica_id": replica.pk, "state": "ready", "endpoint_url": URL, "running": 3, "pid": 4242})
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint_url) == (State.READY, URL)
    live = worker_latest_heartbeat(worker_id=replica.worker_id)
    assert live["replicas"][str(replica.pk)]["running"] == 3 and live["gpus"][0]["utilization_pct"] == 50.0
    # The process the worker runs it in, as reported: how an operator or the chaos suite finds it.
    assert live["replicas"][str(replica.pk)]["pid"] == 4242


def test_a_steady_heartbeat_writes_nothing_to_the_database():
    replica = ReplicaFactory(worker=make_worker(), state=State.READY, endpoint_url=URL)
    report = {"replica_id": replica.pk, "state": "ready", "endpoint_url": URL}
    with CaptureQueriesContext(connection) as queries:
        assert _beat(replica.worker, report) == []
    writes = [q["sql"] for q in queries if not q["sql"].lstrip().upper().startswith("SELECT")]
    assert writes == []


def test_a_failed_load_records_the_reason():
    replica = ReplicaFactory(worker=make_worker(), state=State.LOADING)
    _beat(replica.worker, {"replica_id": replica.pk, "state": "failed", "error": "model path /x does not exist"})
    replica.refresh_from_db()
    assert (replica.state, replica.failure, replica.last_error) == (
        State.FAILED,
        Replica.Failure.LOAD,
        "model path /x does not exist",
    )


def test_the_answer_asks_to_unload_what_the_control_plane_does_not_want():
    worker = make_worker()
    failed = ReplicaFactory(worker=worker, state=State.FAILED)
    elsewhere = ReplicaFactory(worker=make_worker(), state=State.READY, endpoint_url=URL)
    unload = _beat(
        worker,
        {"replica_id": failed.pk, "state": "ready", "endpoint_url": URL},
        {"replica_id": elsewhere.pk, "state": "loading"},
        {"replica_id": 987_654, "state": "ready", "endpoint_url": URL},
    )
    assert sorted(unload) == sorted([failed.pk, elsewhere.pk, 987_654])
    assert (_state(failed), _state(elsewhere)) == (State.FAILED, State.READY)


def test_replicas_the_worker_no_longer_reports_end():
    worker = make_worker()
    ready = ReplicaFactory(worker=worker, state=State.READY, endpoint_url=URL)
    draining = ReplicaFactory(worker=worker, state=State.DRAINING)
    pending = ReplicaFactory(worker=worker, state=State.PENDING)
    _beat(worker)
    assert (_state(ready), _state(draining), _state(pending)) == (State.FAILED, State.STOPPED, State.PENDING)
    ready.refresh_from_db()
    assert ready.failure == Replica.Failure.VANISHED


def test_heartbeats_bring_a_lost_worker_back_and_report_draining():
    worker = make_worker(state=Worker.State.LOST)
    _beat(worker)
    worker.refresh_from_db()
    assert worker.state == Worker.State.ONLINE
    _beat(worker, draining=True)
    worker.refresh_from_db()
    assert worker.state == Worker.State.DRAINING


# --- replicas and their state machine -------------------------------------------------------------


def test_replica_place_sends_the_load_message_after_commit(django_capture_on_commit_callbacks):
    gpu = GpuFactory(worker=make_worker(), index=3, memory_total_bytes=100 * GB)
    model = ModelFactory(
        gpu_memory_bytes=25 * GB,
        context_length=2048,
        max_model_len=4096,
        allow_long_context=True,
        kind="vision",
        max_images_per_request=3,
        max_image_bytes=4000,
        max_image_pixels=10**6,
        low_detail_pixels=256 * 256,
    )
    deployment = DeploymentFactory(model=model)
    with django_capture_on_commit_callbacks(execute=True):
        replica = replica_place(deployment=deployment, worker=gpu.worker, gpu=gpu)
    assert replica.state == State.PENDING
    assert queued_tasks(gpu.worker.queue_name) == [
        (
            "gpuworker.load_model",
            {
                "replica_id": replica.pk,
                "model_path": deployment.model.weights_path,
                "served_model_name": deployment.model.public_name,
                "gpu_index": 3,
                "memory_fraction": 0.25,
                "max_model_len": 4096,  # the catalog's max_model_len, past the checkpoint's 2048
                "allow_long_context": True,
                "dtype": "auto",
                "tensor_parallel_size": 1,
                "expert_parallel": "all_reduce",
                "max_images_per_request": 3,  # the catalog's image limits, for the replica
                "max_image_bytes": 4000,
                "max_image_pixels": 10**6,
                "low_detail_pixels": 256 * 256,
                "quantization": "",  # as the checkpoint is stored
            },
        )
    ]


def test_replica_on_another_workers_gpu_raises_and_writes_nothing():
    with pytest.raises(ValidationError) as error:
        replica_place(deployment=DeploymentFactory(), worker=make_worker(), gpu=GpuFactory())
    assert "gpu" in error.value.message_dict
    assert not Replica.objects.exists()


LEGAL = {(src, dst) for src, targets in Replica.TRANSITIONS.items() for dst in targets}
ILLEGAL = sorted(set(product(State.values, State.values)) - LEGAL)


def test_the_state_machine_matches_the_documented_lifecycle():
    assert LEGAL == {
        ("pending", "loading"),
        ("pending", "stopped"),
        ("pending", "failed"),
        ("loading", "ready"),
        ("loading", "draining"),
        ("loading", "failed"),
        ("ready", "draining"),
        ("ready", "failed"),
        ("draining", "stopped"),
        ("draining", "failed"),
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
    with pytest.raises(ValidationError, match="Unknown replica state"):
        replica_transition(replica=ReplicaFactory(), to_state="sleeping", at=timezone.now())


@pytest.mark.parametrize("url", ["", "gpuworker:8001", "ftp://gpuworker/", "http://"])
def test_ready_needs_a_good_endpoint_url(url):
    replica = ReplicaFactory(state=State.LOADING)
    with pytest.raises(ValidationError) as error:
        replica_transition(replica=replica, to_state=State.READY, at=timezone.now(), endpoint_url=url)
    assert "endpoint_url" in error.value.message_dict
    assert _state(replica) == State.LOADING


# --- operators' actions -------------------------------------------------------------------------


def test_replica_load_on_wants_one_more_and_loads_there(django_capture_on_commit_callbacks):
    gpu = GpuFactory(worker=make_worker(), index=0)
    deployment = DeploymentFactory(desired_replicas=0, max_replicas=2)
    with django_capture_on_commit_callbacks(execute=True):
        replica = replica_load_on(deployment=deployment, worker=gpu.worker, gpu=gpu, actor=None)
    assert (replica.gpu, replica.state) == (gpu, State.PENDING)
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 1
    assert [name for name, _ in queued_tasks(gpu.worker.queue_name)] == ["gpuworker.load_model"]


def test_replica_load_on_refuses_with_reasons():
    gpu = GpuFactory(worker=make_worker(), index=0, memory_total_bytes=10 * GB)
    small = DeploymentFactory(model=ModelFactory(gpu_memory_bytes=GB), desired_replicas=0, max_replicas=1)
    big = DeploymentFactory(model=ModelFactory(gpu_memory_bytes=11 * GB), desired_replicas=0, max_replicas=1)
    cases = [
        (
            dict(deployment=big, worker=gpu.worker, gpu=gpu),
            "gpu",
            f"needs 11.0 GiB; free: {gpu.worker.name} GPU 0 ({gpu.name}) 10.0 GiB of 10.0 GiB",
        ),
        (dict(deployment=small, worker=gpu.worker, gpu=None), "gpu", "choose one"),
        (dict(deployment=small, worker=gpu.worker, gpu=GpuFactory()), "gpu", "not a present GPU"),
        (dict(deployment=small, worker=make_worker(state=Worker.State.DRAINING), gpu=None), "worker", "draining"),
    ]
    for kwargs, field, text in cases:
        with pytest.raises(ValidationError) as error:
            replica_load_on(**kwargs)
        assert text in str(error.value.message_dict[field])
    replica_load_on(deployment=small, worker=gpu.worker, gpu=gpu)
    with pytest.raises(ValidationError, match="max_replicas"):
        replica_load_on(deployment=small, worker=gpu.worker, gpu=gpu)
    assert Replica.objects.count() == 1


def test_replica_load_on_refuses_a_model_too_large_for_its_gpus_with_the_count_it_needs():
    gpu = GpuFactory(worker=make_worker(), index=0, memory_total_bytes=141 * 10**9)
    model = ModelFactory(
        public_name="deepseek-v3",
        parameter_count=671_000_000_000,
        quantization="fp8",
        gpu_memory_bytes=estimate_gpu_memory_bytes(parameter_count=671_000_000_000, quantization="fp8"),
    )
    deployment = DeploymentFactory(model=model, desired_replicas=0, max_replicas=1)
    with pytest.raises(ValidationError) as error:
        replica_load_on(deployment=deployment, worker=gpu.worker, gpu=gpu)
    [message] = error.value.message_dict["gpu"]
    assert message.startswith("deepseek-v3 does not fit: needs 862.4 GiB; free: ")
    assert "deepseek-v3 needs 8 GPUs of 131.3 GiB in FP8, 16 in bf16; its tensor_parallel_size is 1" in message
    assert not Replica.objects.exists()


def test_replica_load_on_refuses_a_gpu_being_measured_saying_so():
    gpu = GpuFactory(worker=make_worker(), index=0, memory_total_bytes=80 * GB)
    QualityMeasurement.objects.create(model=ModelFactory(public_name="smol"), worker=gpu.worker, gpu_index=0)
    deployment = DeploymentFactory(model=ModelFactory(gpu_memory_bytes=GB), desired_replicas=0, max_replicas=1)
    with pytest.raises(ValidationError) as error:
        replica_load_on(deployment=deployment, worker=gpu.worker, gpu=gpu)
    [message] = error.value.message_dict["gpu"]
    assert message.endswith("GPU 0 (NVIDIA H200) 80.0 GiB of 80.0 GiB but measuring the quality of smol.")
    assert not Replica.objects.exists() and Deployment.objects.get(pk=deployment.pk).desired_replicas == 0


def test_replica_load_on_a_cpu_worker():
    worker = make_worker(device=Worker.Device.CPU, cpu_memory_total_bytes=4 * GB)
    deployment = DeploymentFactory(model=ModelFactory(gpu_memory_bytes=GB), desired_replicas=0, max_replicas=2)
    assert replica_load_on(deployment=deployment, worker=worker, gpu=None).gpu is None


def test_replica_unload_drains_and_wants_one_fewer(django_capture_on_commit_callbacks, settings):
    settings.FLEET_UNLOAD_DRAIN_TIMEOUT_SECONDS = 7
    deployment = DeploymentFactory(desired_replicas=2, min_replicas=1, max_replicas=2)
    one, two = (
        ReplicaFactory(deployment=deployment, worker=make_worker(), state=State.READY, endpoint_url=URL)
        for _ in range(2)
    )
    with django_capture_on_commit_callbacks(execute=True):
        replica_unload(replica=one, actor=None)
    assert _state(one) == State.DRAINING and Deployment.objects.get(pk=deployment.pk).desired_replicas == 1
    assert queued_tasks(one.worker.queue_name) == [
        ("gpuworker.unload_model", {"replica_id": one.pk, "drain_timeout_s": 7.0})
    ]
    with pytest.raises(ValidationError, match="min_replicas"):
        replica_unload(replica=two)
    with pytest.raises(ValidationError, match="only a pending, loading or ready replica"):
        replica_unload(replica=one)
    assert _state(two) == State.READY


def test_worker_drain_moves_replicas_off_and_tells_the_worker(django_capture_on_commit_callbacks):
    worker = make_worker()
    ready = ReplicaFactory(worker=worker, state=State.READY, endpoint_url=URL)
    pending = ReplicaFactory(worker=worker, state=State.PENDING)
    with django_capture_on_commit_callbacks(execute=True):
        worker_drain(worker=worker, actor=None)
    worker.refresh_from_db()
    assert (worker.state, _state(ready), _state(pending)) == (Worker.State.DRAINING, State.DRAINING, State.STOPPED)
    assert queued_tasks(worker.queue_name) == [("gpuworker.drain_worker", {"timeout_s": 60.0})]
    with pytest.raises(ValidationError, match="only an online worker can be drained"):
        worker_drain(worker=worker)


# --- Deployments


def test_deployment_create():
    model = ModelFactory()
    deployment = deployment_create(model_name=model.public_name, desired_replicas=2, min_replicas=1, max_replicas=4)
    deployment.refresh_from_db()
    assert (deployment.model, deployment.desired_replicas, deployment.min_replicas, deployment.max_replicas) == (
        model,
        2,
        1,
        4,
    )


def test_deployment_of_unknown_model_raises_and_writes_nothing():
    ModelFactory(public_name="known")
    with pytest.raises(ValidationError) as error:
        deployment_create(model_name="unknown")
    assert "unknown" in str(error.value.message_dict["model"])
    assert not Deployment.objects.exists()


@pytest.mark.parametrize(
    ("desired", "low", "high", "field"),
    [
        (-1, 0, 1, "desired_replicas"),
        (1, -1, 1, "min_replicas"),
        (1, 0, -2, "max_replicas"),
        (3, 0, 2, "__all__"),  # desired above max
        (0, 1, 2, "__all__"),  # desired below min
        (2, 3, 2, "__all__"),  # min above max
    ],
)
def test_invalid_replica_counts_raise_and_write_nothing(desired, low, high, field):
    model = ModelFactory()
    with pytest.raises(ValidationError) as error:
        deployment_create(model_name=model.public_name, desired_replicas=desired, min_replicas=low, max_replicas=high)
    assert field in error.value.message_dict
    assert not Deployment.objects.exists()


def test_a_model_has_at_most_one_deployment():
    deployment = DeploymentFactory()
    with pytest.raises(ValidationError) as error:
        deployment_create(model_name=deployment.model.public_name)
    assert "model" in error.value.message_dict
    assert Deployment.objects.count() == 1


def test_deployment_scale_within_bounds():
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=3)
    deployment_scale(deployment=deployment, desired_replicas=3)
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 3


@pytest.mark.parametrize("desired", [-1, 4])
def test_deployment_scale_out_of_bounds_raises_and_keeps_the_old_count(desired):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=3)
    with pytest.raises(ValidationError):
        deployment_scale(deployment=deployment, desired_replicas=desired)
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 1


def test_deployment_wake_wants_one_replica_once_audited_as_the_system(django_capture_on_commit_callbacks):
    deployment = DeploymentFactory(desired_replicas=0, min_replicas=0, max_replicas=3)
    with django_capture_on_commit_callbacks() as callbacks:
        assert deployment_wake(model_id=deployment.model_id) is True
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 1
    assert len(callbacks) == 2  # the fleet page's update and the reconcile request, after commit
    [entry] = AuditEntry.objects.filter(action=AuditEntry.Action.DEPLOYMENT_SCALE)
    assert entry.actor is None and entry.actor_label == "system" and entry.target_id == str(deployment.pk)
    assert entry.detail["desired_replicas"] == [0, 1] and "cold start" in entry.detail["reason"]
    # Already awake: nothing written, nothing sent.
    with django_capture_on_commit_callbacks() as callbacks:
        assert deployment_wake(model_id=deployment.model_id) is True
    assert not callbacks and AuditEntry.objects.count() == 1
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 1


def test_deployment_wake_keeps_a_larger_desired_count():
    deployment = DeploymentFactory(desired_replicas=2, min_replicas=0, max_replicas=3)
    assert deployment_wake(model_id=deployment.model_id) is True
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 2 and not AuditEntry.objects.exists()


def test_deployment_wake_refuses_a_model_that_may_have_no_replica():
    deployment = DeploymentFactory(desired_replicas=0, min_replicas=0, max_replicas=0)
    assert deployment_wake(model_id=deployment.model_id) is False
    assert deployment_wake(model_id=ModelFactory().pk) is False  # no deployment at all
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 0 and not AuditEntry.objects.exists()


# --- retry now ---------------------------------------------------------------------------------


def test_retry_now_forgets_the_backoff_is_audited_and_reconciles_at_once(settings, django_capture_on_commit_callbacks):
    settings.FLEET_LOAD_RETRY_INITIAL_SECONDS = 300
    worker = GpuFactory(worker=make_worker(), index=0).worker
    deployment = DeploymentFactory(model=ModelFactory(gpu_memory_bytes=GB), desired_replicas=1, max_replicas=1)
    now = timezone.now()
    [replica_id] = deployment_reconcile(deployment_id=deployment.pk, now=now).placed
    _beat(worker, {"replica_id": replica_id, "state": "failed", "error": "checkpoint not there yet"}, now=now)
    assert deployment_reconcile(deployment_id=deployment.pk, now=now).placed == []  # backing off for 5 minutes

    with django_capture_on_commit_callbacks(execute=True):
        deployment_retry_loads(deployment=deployment, actor=None)
    assert not LoadBackoff.objects.exists()
    entry = AuditEntry.objects.get(action=AuditEntry.Action.DEPLOYMENT_RETRY)
    assert (entry.target_id, entry.detail) == (str(deployment.pk), {"backoffs": {worker.name: 1}})
    assert ("controlplane.fleet.tasks.reconcile", {"deployment_ids": [deployment.pk]}) in queued_tasks(
        celery_app.conf.task_default_queue
    )
    assert len(deployment_reconcile(deployment_id=deployment.pk, now=now).placed) == 1

    # Nothing left to retry: refused, nothing written.
    with pytest.raises(ValidationError, match="no failed loads to retry"):
        deployment_retry_loads(deployment=deployment, actor=None)
    assert AuditEntry.objects.filter(action=AuditEntry.Action.DEPLOYMENT_RETRY).count() == 1


def test_replica_load_on_a_split_model_takes_the_chosen_gpu_and_the_next(django_capture_on_commit_callbacks):
    worker = make_worker()
    gpus = [GpuFactory(worker=worker, index=i, memory_total_bytes=10 * GB) for i in range(2)]
    deployment = DeploymentFactory(
        model=ModelFactory(gpu_memory_bytes=16 * GB, tensor_parallel_size=2), desired_replicas=0, max_replicas=2
    )
    with pytest.raises(ValidationError) as error:
        replica_load_on(deployment=deployment, worker=worker, gpu=gpus[1])
    assert "from GPU 1 it needs GPUs 1–2" in str(error.value.message_dict["gpu"])
    with django_capture_on_commit_callbacks(execute=True):
        replica = replica_load_on(deployment=deployment, worker=worker, gpu=gpus[0])
    assert (replica.gpu_indexes, replica.tensor_parallel_size) == ([0, 1], 2)
    [(_, kwargs)] = queued_tasks(worker.queue_name)
    assert (kwargs["gpu_index"], kwargs["tensor_parallel_size"], kwargs["memory_fraction"]) == (0, 2, 0.8)
    with pytest.raises(ValidationError) as error:  # both GPUs now hold 8 GiB of it
        replica_load_on(deployment=deployment, worker=worker, gpu=gpus[0])
    assert (
        f"needs 8.0 GiB on each of 2 GPUs of one worker (16.0 GiB in all); free: {worker.name} GPU 0 "
        f"({gpus[0].name}) 2.0 GiB of 10.0 GiB; {worker.name} GPU 1 ({gpus[1].name}) 2.0 GiB of 10.0 GiB"
    ) in str(error.value.message_dict["gpu"])
