import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.catalog.models import Model
from controlplane.catalog.services import estimate_gpu_memory_bytes
from controlplane.fleet.models import LoadBackoff, QualityMeasurement, Replica, Worker
from controlplane.fleet.reconcile import deployment_reconcile, fleet_reconcile
from controlplane.fleet.selectors import deployment_statuses, placement_slots
from controlplane.fleet.services.heartbeats import worker_heartbeat
from controlplane.fleet.services.quality import quality_measurement_progress, quality_measurement_request
from controlplane.fleet.services.replicas import replica_transition
from controlplane.fleet.services.workers import worker_register
from gpuworker.contract.heartbeat import parse_heartbeat, parse_registration
from gpuworker.contract.quality import DONE, FAILED, RUNNING, PerplexityReport, QualityProgress
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker, queued_tasks

GB = 1024**3
State = Replica.State
URL = "http://127.0.0.1:8101"


def _gpu_worker(memory=80 * GB, **fields):
    return GpuFactory(worker=make_worker(**fields), index=0, memory_total_bytes=memory).worker


def _deployment(desired, memory=10 * GB, **fields):
    return DeploymentFactory(
        model=ModelFactory(gpu_memory_bytes=memory), desired_replicas=desired, max_replicas=max(desired, 4), **fields
    )


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
    # What it needs and what was free, per GPU, in human units (the drained and lost workers take
    # no replicas, so they are not offered).
    online = Worker.objects.get(state=Worker.State.ONLINE)
    assert status.state == "waiting"
    assert status.message == (
        f"0 of 1 ready; {second.model.public_name} needs 10.0 GiB; free: "
        f"{online.name} GPU 0 (NVIDIA H200) 5.0 GiB of 15.0 GiB."
    )


@pytest.mark.django_db
def test_a_cpu_worker_takes_replicas_within_its_memory():
    worker = make_worker(device=Worker.Device.CPU, cpu_memory_total_bytes=3 * GB)
    deployment = _deployment(4, memory=GB)
    outcome = _reconcile(deployment)
    assert len(outcome.placed) == 3 and outcome.unplaced == 1
    assert set(Replica.objects.values_list("worker_id", "gpu_id")) == {(worker.pk, None)}


@pytest.mark.django_db
def test_scale_down_removes_pending_then_the_least_busy(django_capture_on_commit_callbacks):
    worker = _gpu_worker()
    deployment = _deployment(1)
    busy, idle = (
        ReplicaFactory(deployment=deployment, worker=worker, state=State.READY, endpoint_url=URL) for _ in range(2)
    )
    pending = ReplicaFactory(deployment=deployment, worker=worker)
    worker_heartbeat(
        worker_id=worker.pk,
        now=timezone.now(),
        heartbeat=parse_heartbeat(
            {
                "replicas": [
                    {"replica_id": busy.pk, "state": "ready", "endpoint_url": URL, "running": 4},
                    {"replica_id": idle.pk, "state": "ready", "endpoint_url": URL, "running": 0},
                ]
            }
        ),
    )
    with django_capture_on_commit_callbacks(execute=True):
        outcome = _reconcile(deployment)
    assert sorted(outcome.removed) == sorted([pending.pk, idle.pk])
    states = dict(Replica.objects.values_list("pk", "state"))
    assert (states[busy.pk], states[idle.pk], states[pending.pk]) == (State.READY, State.DRAINING, State.STOPPED)
    unloads = sorted(
        kwargs["replica_id"] for name, kwargs in queued_tasks(worker.queue_name) if name == "gpuworker.unload_model"
    )
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
    replica_transition(
        replica=replica, to_state=State.FAILED, at=timezone.now(), error="gone", failure=Replica.Failure.WORKER_LOST
    )
    statuses = {s.deployment_id: s for s in deployment_statuses()}
    assert [statuses[d.pk].state for d in (ready, scaling, stopped, lost)] == ["ready", "scaling", "stopped", "waiting"]
    assert statuses[lost.pk].last_error == f"{worker.name}: gone"
    assert (statuses[scaling.pk].ready, statuses[scaling.pk].starting) == (0, 1)


# --- Failed loads: retried with backoff per (deployment, worker), never given up for good -------

CAUSE = (
    "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 20017): address already "
    "in use (the replica's port was taken between the check and the bind)"
)
ERROR = f'{CAUSE}\nTraceback (most recent call last):\n  File "server.py", line 1, in run\nOSError: [Errno 98]'


def _fail(replica_id, at, error=ERROR):
    replica = Replica.objects.get(pk=replica_id)
    worker_heartbeat(
        worker_id=replica.worker_id,
        now=at,
        heartbeat=parse_heartbeat({"replicas": [{"replica_id": replica_id, "state": "failed", "error": error}]}),
    )


def _become_ready(replica_id, at):
    replica = Replica.objects.get(pk=replica_id)
    worker_heartbeat(
        worker_id=replica.worker_id,
        now=at,
        heartbeat=parse_heartbeat({"replicas": [{"replica_id": replica_id, "state": "ready", "endpoint_url": URL}]}),
    )


def _place(deployment, at):
    """A reconcile pass as beat would run it at `at`: nothing but the database carries over, as in
    a freshly started control plane."""
    [outcome] = fleet_reconcile(now=at, deployment_ids=[deployment.pk])
    return outcome


@pytest.fixture
def retry_settings(settings):
    settings.FLEET_LOAD_RETRY_INITIAL_SECONDS = 10
    settings.FLEET_LOAD_RETRY_MAX_SECONDS = 30
    settings.FLEET_LOAD_DEGRADED_AFTER_FAILURES = 3
    return settings


@pytest.mark.django_db
def test_a_failed_load_is_retried_on_its_only_worker_once_its_backoff_has_passed(retry_settings):
    worker = _gpu_worker()
    deployment = _deployment(1)
    t0 = timezone.now()
    [first] = _place(deployment, t0).placed
    _fail(first, t0)
    backoff = LoadBackoff.objects.get(deployment=deployment, worker=worker)
    assert (backoff.consecutive_failures, backoff.next_attempt_at, backoff.last_error) == (
        1,
        t0 + timedelta(seconds=10),
        ERROR,
    )

    # Before its time the worker is left alone, and the page says why and until when.
    early = _place(deployment, t0 + timedelta(seconds=9))
    assert early.placed == [] and early.unplaced == 1
    until = timezone.localtime(t0 + timedelta(seconds=10)).strftime("%H:%M:%S")
    assert (
        f"{worker.name} GPU 0 (NVIDIA H200) 80.0 GiB of 80.0 GiB but backing off until {until} after 1 failed load"
        in early.reason
    )
    [status] = deployment_statuses(deployment_ids=[deployment.pk], now=t0 + timedelta(seconds=9))
    assert status.state == "waiting" and early.reason in status.message
    assert status.last_error == f"{worker.name}: {CAUSE}"  # the cause in full, before any traceback
    assert "Traceback" in status.error_detail

    # A control plane started afresh later (a new reconcile reading only the database) retries it.
    [second] = _place(deployment, t0 + timedelta(seconds=10)).placed
    assert Replica.objects.get(pk=second).worker_id == worker.pk
    _fail(second, t0 + timedelta(seconds=11))
    assert LoadBackoff.objects.get(pk=backoff.pk).next_attempt_at == t0 + timedelta(seconds=31)  # doubled
    assert _place(deployment, t0 + timedelta(seconds=30)).placed == []
    [third] = _place(deployment, t0 + timedelta(seconds=31)).placed

    # Ready clears the backoff: the next failure there starts from the initial delay again.
    _become_ready(third, t0 + timedelta(seconds=40))
    assert not LoadBackoff.objects.exists()
    [status] = deployment_statuses(deployment_ids=[deployment.pk])
    assert status.state == "ready" and status.backoffs == []


@pytest.mark.django_db
def test_a_failed_load_is_placed_on_another_worker_first(retry_settings):
    a, b = _gpu_worker(), _gpu_worker()
    deployment = _deployment(1)
    t0 = timezone.now()
    [first] = _place(deployment, t0).placed
    failed_on = Replica.objects.get(pk=first).worker_id
    _fail(first, t0)
    [second] = _place(deployment, t0).placed
    assert Replica.objects.get(pk=second).worker_id == ({a.pk, b.pk} - {failed_on}).pop()


@pytest.mark.django_db
def test_a_worker_whose_backoff_passed_comes_after_one_where_the_model_never_failed(retry_settings):
    a, b = _gpu_worker(), _gpu_worker()
    deployment = _deployment(2)
    t0 = timezone.now()
    placed = _place(deployment, t0).placed
    on_a = Replica.objects.get(pk__in=placed, worker=a).pk
    _become_ready(Replica.objects.get(pk__in=placed, worker=b).pk, t0)
    _fail(on_a, t0)
    # Well after the backoff: b (healthy, already one replica) and a (failed once) are both
    # eligible; spreading still wins, so a is retried rather than packing b.
    [retry] = _place(deployment, t0 + timedelta(minutes=5)).placed
    assert Replica.objects.get(pk=retry).worker_id == a.pk


@pytest.mark.django_db
def test_repeated_failures_mark_the_deployment_degraded_and_it_keeps_retrying_at_the_cap(retry_settings):
    worker = _gpu_worker()
    deployment = _deployment(1)
    at = timezone.now()
    for n in range(1, 5):
        [replica_id] = _place(deployment, at).placed
        _fail(replica_id, at)
        backoff = LoadBackoff.objects.get(deployment=deployment)
        assert backoff.consecutive_failures == n
        assert (backoff.next_attempt_at - at).total_seconds() == [10, 20, 30, 30][n - 1]
        [status] = deployment_statuses(deployment_ids=[deployment.pk], now=at)
        assert status.state == ("degraded" if n >= 3 else "waiting")
        at = backoff.next_attempt_at
    assert status.last_error == f"{worker.name}: {CAUSE}"
    assert "4 loads failed in a row" in status.message
    [view] = status.backoffs
    assert (view.worker_name, view.consecutive_failures, view.cause) == (worker.name, 4, CAUSE)
    # Still retried when its time comes.
    assert len(_place(deployment, at).placed) == 1


@pytest.mark.django_db
def test_a_replica_dying_before_ready_backs_off_but_one_crashing_after_ready_does_not(retry_settings):
    worker = _gpu_worker()
    loading, serving = _deployment(1), _deployment(1)
    t0 = timezone.now()
    [a] = _place(loading, t0).placed
    [b] = _place(serving, t0).placed
    worker_heartbeat(
        worker_id=worker.pk,
        now=t0,
        heartbeat=parse_heartbeat(
            {
                "replicas": [
                    {"replica_id": a, "state": "loading"},
                    {"replica_id": b, "state": "ready", "endpoint_url": URL},
                ]
            }
        ),
    )
    worker_heartbeat(
        worker_id=worker.pk,
        now=t0,
        heartbeat=parse_heartbeat(
            {
                "replicas": [
                    {"replica_id": a, "state": "failed", "error": "killed"},
                    {"replica_id": b, "state": "failed", "error": "killed"},
                ]
            }
        ),
    )
    assert list(LoadBackoff.objects.values_list("deployment_id", flat=True)) == [loading.pk]
    assert len(_place(serving, t0).placed) == 1


@pytest.mark.django_db
def test_editing_the_model_gives_every_worker_a_fresh_start(retry_settings):
    _gpu_worker()
    deployment = _deployment(1)
    t0 = timezone.now()
    [first] = _place(deployment, t0).placed
    _fail(first, t0)
    assert _place(deployment, t0).placed == []
    Model.objects.filter(pk=deployment.model_id).update(updated_at=t0 + timedelta(seconds=1))
    [second] = _place(deployment, t0 + timedelta(seconds=2)).placed
    _fail(second, t0 + timedelta(seconds=2))
    assert LoadBackoff.objects.get(deployment=deployment).consecutive_failures == 1  # counted afresh


# --- tensor parallel: a replica split over N GPUs of one worker ------------------------------------


def _register(name, gpus):
    """A GPU worker registered through the service, as its daemon does (the daemon itself is outside)."""
    return worker_register(
        registration=parse_registration(
            {
                "name": name,
                "advertise_host": "10.0.0.5",
                "device": "cuda",
                "gpus": [{"index": i, "name": "NVIDIA H200", "memory_total_bytes": m} for i, m in enumerate(gpus)],
                "cpu": {"memory_total_bytes": 256 * GB, "cores": 32},
            }
        ),
        now=timezone.now(),
    )


def _split_deployment(desired, memory, size=2):
    return DeploymentFactory(
        model=ModelFactory(gpu_memory_bytes=memory, tensor_parallel_size=size),
        desired_replicas=desired,
        max_replicas=max(desired, 4),
    )


@pytest.mark.django_db
def test_a_split_replica_is_placed_on_consecutive_gpus_of_one_worker_and_they_count_as_used(
    django_capture_on_commit_callbacks,
):
    worker = _register(f"tp-{uuid.uuid4().hex[:8]}", [80 * GB] * 4)
    deployment = _split_deployment(1, memory=100 * GB)
    with django_capture_on_commit_callbacks(execute=True):
        [placed] = _reconcile(deployment).placed
    replica = Replica.objects.select_related("gpu").get(pk=placed)
    assert (replica.worker_id, replica.gpu.index, replica.tensor_parallel_size) == (worker.pk, 0, 2)
    assert (replica.gpu_indexes, replica.gpus_label) == ([0, 1], "GPUs 0–1")
    [(name, kwargs)] = queued_tasks(worker.queue_name)
    # 50 GiB (its share) of each 80 GiB GPU.
    assert (name, kwargs["gpu_index"], kwargs["tensor_parallel_size"], kwargs["memory_fraction"]) == (
        "gpuworker.load_model",
        0,
        2,
        0.625,
    )
    assert [s.used_bytes for s in placement_slots(workers=[worker])] == [50 * GB, 50 * GB, 0, 0]
    # The next replica goes on GPUs 2-3; a one-GPU model needing 40 GiB then finds no room anywhere.
    deployment.desired_replicas = 2
    deployment.save()
    [second] = _reconcile(deployment).placed
    assert Replica.objects.get(pk=second).gpu_indexes == [2, 3]
    single = _deployment(1, memory=40 * GB)
    outcome = _reconcile(single)
    assert outcome.unplaced == 1 and outcome.reason.startswith("needs 40.0 GiB; free: ")


H200 = 141 * 10**9  # "141 GB"


def _sized_deployment(name, parameters, quantization="", size=1):
    """A catalog entry sized as the catalog sizes it (catalog.services.estimate_gpu_memory_bytes)."""
    need = estimate_gpu_memory_bytes(parameter_count=parameters, quantization=quantization)
    model = ModelFactory(
        public_name=f"{name}-{uuid.uuid4().hex[:6]}",
        parameter_count=parameters,
        quantization=quantization,
        gpu_memory_bytes=need,
        tensor_parallel_size=size,
    )
    return DeploymentFactory(model=model, desired_replicas=1, max_replicas=1)


@pytest.mark.django_db
def test_a_671b_model_on_one_141_gb_gpu_is_refused_with_the_gpus_it_needs():
    _register(f"h200-{uuid.uuid4().hex[:8]}", [H200])
    deployment = _sized_deployment("deepseek-v3", 671_000_000_000, quantization="fp8")
    outcome = _reconcile(deployment)
    assert outcome.unplaced == 1 and not Replica.objects.filter(deployment=deployment).exists()
    name = deployment.model.public_name
    assert outcome.reason.endswith(
        f"{name} needs 8 GPUs of 131.3 GiB in FP8, 16 in bf16; its tensor_parallel_size is 1: set it to 8 "
        "(its heads and experts must divide by it) on workers with as many GPUs"
    )
    [status] = deployment_statuses(deployment_ids=[deployment.pk])
    assert "needs 8 GPUs of 131.3 GiB in FP8, 16 in bf16" in status.message


@pytest.mark.django_db
def test_an_int4_model_too_large_for_one_gpu_is_not_told_to_split():
    # AWQ and GPTQ checkpoints are not split over GPUs (gpuworker.contract.placement.UNSPLIT_QUANTIZATIONS).
    _register(f"h200-{uuid.uuid4().hex[:8]}", [H200, H200])
    deployment = _sized_deployment("kimi-awq", 1_000_000_000_000, quantization="awq-int4")
    outcome = _reconcile(deployment)
    assert outcome.unplaced == 1
    assert outcome.reason.endswith(
        "its tensor_parallel_size is 1, and its AWQ INT4 checkpoint runs on one GPU: it needs a larger GPU"
    )


@pytest.mark.django_db
def test_a_model_that_needs_two_gpus_is_placed_over_two_and_refused_on_one(django_capture_on_commit_callbacks):
    """70B in bf16 (168 GB with its KV headroom) takes two 141 GB GPUs: placed with tensor_parallel_size
    2, and a one-GPU setting is refused saying so (in FP8 one GPU would do)."""
    worker = _register(f"h200-{uuid.uuid4().hex[:8]}", [H200, H200])
    on_one = _sized_deployment("llama-70b", 70_000_000_000)
    outcome = _reconcile(on_one)
    assert outcome.unplaced == 1
    assert "needs 1 GPU of 131.3 GiB in FP8, 2 in bf16; its tensor_parallel_size is 1: set it to 2" in outcome.reason
    split = _sized_deployment("llama-70b", 70_000_000_000, size=2)
    with django_capture_on_commit_callbacks(execute=True):
        [placed] = _reconcile(split).placed
    replica = Replica.objects.get(pk=placed)
    assert (replica.worker_id, replica.gpu_indexes, replica.tensor_parallel_size) == (worker.pk, [0, 1], 2)
    [(_, kwargs)] = queued_tasks(worker.queue_name)
    assert (kwargs["tensor_parallel_size"], kwargs["expert_parallel"]) == (2, "all_reduce")


@pytest.mark.django_db
def test_a_split_moe_replica_is_told_how_to_join_its_experts(django_capture_on_commit_callbacks):
    worker = _register(f"tp-{uuid.uuid4().hex[:8]}", [80 * GB] * 2)
    model = ModelFactory(gpu_memory_bytes=100 * GB, tensor_parallel_size=2, expert_parallel="all_to_all")
    deployment = DeploymentFactory(model=model, desired_replicas=1, max_replicas=1)
    with django_capture_on_commit_callbacks(execute=True):
        _reconcile(deployment)
    [(_, kwargs)] = queued_tasks(worker.queue_name)
    assert (kwargs["tensor_parallel_size"], kwargs["expert_parallel"]) == (2, "all_to_all")


@pytest.mark.django_db
def test_free_gpus_on_two_workers_do_not_hold_a_split_replica_and_the_reason_says_so():
    a, b = (_register(f"tp-{uuid.uuid4().hex[:8]}", [80 * GB]) for _ in range(2))
    deployment = _split_deployment(1, memory=100 * GB)
    outcome = _reconcile(deployment)
    assert outcome.unplaced == 1 and not Replica.objects.filter(deployment=deployment).exists()
    assert outcome.reason == (
        f"needs 50.0 GiB on each of 2 GPUs of one worker (100.0 GiB in all); free: "
        f"{a.name} GPU 0 (NVIDIA H200) 80.0 GiB of 80.0 GiB; "
        f"{b.name} GPU 0 (NVIDIA H200) 80.0 GiB of 80.0 GiB"
    )
    [status] = deployment_statuses(deployment_ids=[deployment.pk])
    assert status.state == "waiting" and outcome.reason in status.message


@pytest.mark.django_db
def test_a_model_served_fp8_at_load_is_loaded_with_fp8_asked_for(django_capture_on_commit_callbacks):
    worker = _register(f"fp8-{uuid.uuid4().hex[:8]}", [80 * GB])
    fp8 = ModelFactory(gpu_memory_bytes=10 * GB, quantization="fp8", load_quantization="fp8")
    stored = ModelFactory(gpu_memory_bytes=10 * GB, quantization="fp8")
    for model in (fp8, stored):
        with django_capture_on_commit_callbacks(execute=True):
            _reconcile(DeploymentFactory(model=model, desired_replicas=1, max_replicas=1))
    loads = {kwargs["served_model_name"]: kwargs["quantization"] for _, kwargs in queued_tasks(worker.queue_name)}
    assert loads == {fp8.public_name: "fp8", stored.public_name: ""}


def _measured_model_on(worker):
    """A model whose checkpoint `worker` reports, measured there now: the measurement takes its free GPU."""
    worker.model_roots, worker.model_paths = ["/models"], ["/models/smol"]
    worker.save()
    measurement = quality_measurement_request(model=ModelFactory(public_name="smol", weights_path="/models/smol"))
    assert (measurement.worker_id, measurement.gpu_index) == (worker.pk, 0)
    return measurement


@pytest.mark.django_db
def test_a_gpu_being_measured_takes_no_replica_until_the_measurement_is_done():
    worker = _gpu_worker()
    measurement = _measured_model_on(worker)
    deployment = _deployment(1)
    waiting = _reconcile(deployment)
    assert (waiting.placed, waiting.unplaced) == ([], 1)
    assert waiting.reason == (
        f"needs 10.0 GiB; free: {worker.name} GPU 0 (NVIDIA H200) 80.0 GiB of 80.0 GiB "
        f"but measuring the quality of smol"
    )
    [status] = deployment_statuses(deployment_ids=[deployment.pk])
    assert status.state == "waiting" and waiting.reason in status.message
    # Running still holds it; done frees it for the next pass.
    quality_measurement_progress(worker_id=worker.pk, measurement_id=measurement.pk, progress=QualityProgress(RUNNING))
    assert _reconcile(deployment).placed == []
    report = PerplexityReport(perplexity=12.5, tokens=93, window=32, text_sha256="a" * 64)
    done = QualityProgress(DONE, report=report)
    quality_measurement_progress(worker_id=worker.pk, measurement_id=measurement.pk, progress=done)
    [placed] = _reconcile(deployment).placed
    assert Replica.objects.get(pk=placed).gpu.index == 0


@pytest.mark.django_db
def test_a_failed_measurement_or_one_on_a_cpu_worker_holds_nothing():
    worker = _gpu_worker()
    measurement = _measured_model_on(worker)
    failed = QualityProgress(FAILED, error="out of memory")
    quality_measurement_progress(worker_id=worker.pk, measurement_id=measurement.pk, progress=failed)
    assert [slot.taken_by for slot in placement_slots(workers=[worker])] == [""]
    cpu = make_worker(device=Worker.Device.CPU, cpu_memory_total_bytes=30 * GB)
    QualityMeasurement.objects.create(model=ModelFactory(), worker=cpu, gpu_index=None)
    assert len(_reconcile(_deployment(2)).placed) == 2
    assert Replica.objects.filter(worker=cpu).count() == 1


@pytest.mark.django_db
def test_a_split_replica_is_not_placed_over_a_gpu_being_measured():
    worker = _register(f"tp-{uuid.uuid4().hex[:8]}", [80 * GB] * 3)
    QualityMeasurement.objects.create(model=ModelFactory(public_name="smol"), worker=worker, gpu_index=1)
    deployment = _split_deployment(2, memory=100 * GB)
    outcome = _reconcile(deployment)
    # GPUs 0-1 and 1-2 both include the measured GPU 1: neither run takes the replica.
    assert (outcome.placed, outcome.unplaced) == ([], 2)
    assert f"{worker.name} GPU 1 (NVIDIA H200) 80.0 GiB of 80.0 GiB but measuring the quality of smol" in outcome.reason
