"""Quality measurements: an operator asks a worker that has a model's checkpoint to measure its
perplexity (the MeasureQuality task); the worker reports it running, then done or failed. A done
report is recorded on the model by the catalog's model_record_perplexity, the one path a perplexity
takes into the catalog (the record_perplexity command uses it too).

Where it runs: on a GPU worker, a GPU that holds no replica (the measurement is a process of its
own, so it must not share a replica's GPU memory); on a CPU worker, its CPU. A worker whose GPUs
all hold replicas is not asked: the operator measures once a GPU is free."""

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.catalog.models import Model
from controlplane.catalog.selectors import weights_path_reports
from controlplane.catalog.services import model_record_perplexity
from controlplane.fleet import commands
from controlplane.fleet.models import QualityMeasurement, Replica, Worker
from controlplane.fleet.placement import held_gpu_indexes
from gpuworker.contract.quality import FAILED, RUNNING, QualityProgress
from gpuworker.contract.tasks import MeasureQuality


class MeasurementUnknown(Exception):
    pass


def _free_gpu_index(worker: Worker) -> int | None:
    """A present GPU of `worker` that no active replica holds (None: on a CPU worker, its CPU);
    ValidationError when every GPU holds one."""
    if worker.device != Worker.Device.CUDA:
        return None
    held = {
        index
        for first, size in Replica.objects.filter(
            worker=worker, state__in=Replica.ACTIVE_STATES, gpu__isnull=False
        ).values_list("gpu__index", "tensor_parallel_size")
        for index in held_gpu_indexes(first_index=first, tensor_parallel_size=size)
    }
    free = sorted(gpu.index for gpu in worker.gpus.filter(present=True) if gpu.index not in held)
    if not free:
        raise ValidationError(
            f"Every GPU of {worker.name} holds a replica, and a measurement runs on a GPU of its own: "
            f"measure once a GPU is free."
        )
    return free[0]


def _choose_place(model: Model) -> tuple[Worker, int | None]:
    """The first online worker (CPU workers last, then by name) that reports the checkpoint and
    has a device free for it, and that device; ValidationError saying why there is none."""
    # Locked as reconcile locks them while it places replicas (in the same order), so a GPU is never
    # chosen for a measurement and for a replica at once.
    locked = Worker.objects.select_for_update(no_key=True).filter(state=Worker.State.ONLINE).order_by("pk")
    online = sorted(locked, key=lambda worker: (worker.device == Worker.Device.CPU, worker.name))
    reports = weights_path_reports(weights_path=model.weights_path, workers=online)
    having = [worker for worker, report in zip(online, reports) if report.loadable]
    if not having:
        raise ValidationError(
            f"No online worker reports the checkpoint at {model.weights_path} under its model roots: start "
            f"one (or copy the checkpoint under a root), then measure again."
        )
    refusals = []
    for worker in having:
        try:
            return worker, _free_gpu_index(worker)
        except ValidationError as exc:
            refusals.extend(exc.messages)
    raise ValidationError(" ".join(refusals))


@transaction.atomic
def quality_measurement_request(
    *, model: Model, actor=None, window: int | None = None, max_tokens: int | None = None
) -> QualityMeasurement:
    """Ask a worker that has `model`'s checkpoint to measure its perplexity (after commit); audited.
    ValidationError when one is already in progress, or no worker or device can run it."""
    model = Model.objects.select_for_update().get(pk=model.pk)
    in_progress = model.quality_measurements.filter(state__in=QualityMeasurement.IN_PROGRESS).select_related("worker")
    for earlier in in_progress:
        if earlier.worker.state == Worker.State.ONLINE:
            raise ValidationError(
                f"{model.public_name} is already being measured on {earlier.worker.name} ({earlier.state})."
            )
        _finish(earlier, state=QualityMeasurement.State.FAILED, error=f"worker {earlier.worker.name} went away")
    worker, gpu_index = _choose_place(model)
    measurement = QualityMeasurement.objects.create(model=model, worker=worker, gpu_index=gpu_index)
    commands.send_to_worker(
        queue=worker.queue_name,
        task=MeasureQuality(
            measurement_id=measurement.pk,
            model_path=model.weights_path,
            gpu_index=gpu_index,
            quantization=model.load_quantization,
            window=window,
            max_tokens=max_tokens,
        ),
    )
    audit_record(
        actor=actor,
        action=AuditEntry.Action.MODEL_MEASURE_QUALITY,
        target=model,
        detail={"worker": worker.name, "device": measurement.device_label, "measurement": measurement.pk},
    )
    return measurement


def quality_measurements_abandon(*, worker: Worker, now) -> int:
    """Fail the measurements `worker` had in progress: it registered again, so its daemon started
    afresh and runs none of them (a message still queued for it is refused when it reports)."""
    return QualityMeasurement.objects.filter(worker=worker, state__in=QualityMeasurement.IN_PROGRESS).update(
        state=QualityMeasurement.State.FAILED,
        error=f"worker {worker.name} restarted before it finished; measure again",
        state_changed_at=now,
    )


def _finish(measurement: QualityMeasurement, *, state: str, error: str = "") -> None:
    measurement.state, measurement.error, measurement.state_changed_at = state, error, timezone.now()
    measurement.save(update_fields=["state", "error", "state_changed_at"])


def quality_measurement_progress(
    *, worker_id: int, measurement_id: int, progress: QualityProgress
) -> QualityMeasurement:
    """Record what the worker says about its measurement. A done report goes to the catalog through
    model_record_perplexity; one it refuses (of other weights than the model serves) fails the
    measurement with its reason, and the ValidationError is raised for the worker too.
    MeasurementUnknown: no such measurement of this worker. A finished one changes no more."""
    with transaction.atomic():
        measurement = (
            QualityMeasurement.objects.select_for_update()
            .select_related("model")
            .filter(pk=measurement_id, worker_id=worker_id)
            .first()
        )
        if measurement is None:
            raise MeasurementUnknown(f"worker {worker_id} has no quality measurement {measurement_id}")
        if measurement.state not in QualityMeasurement.IN_PROGRESS:
            raise ValidationError({"state": f"Measurement {measurement_id} is already {measurement.state}."})
        if progress.state == RUNNING:
            _finish(measurement, state=QualityMeasurement.State.RUNNING)
            return measurement
        if progress.state == FAILED:
            _finish(measurement, state=QualityMeasurement.State.FAILED, error=progress.error)
            return measurement
        try:  # DONE: the contract's parser guarantees a report
            with transaction.atomic():
                model_record_perplexity(model=measurement.model, report=progress.report)
        except ValidationError as exc:
            refusal = exc
            _finish(measurement, state=QualityMeasurement.State.FAILED, error=" ".join(exc.messages))
        else:
            _finish(measurement, state=QualityMeasurement.State.DONE)
            return measurement
    raise refusal
