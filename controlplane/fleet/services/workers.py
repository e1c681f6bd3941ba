"""Workers: registration (a daemon starting, or starting again), state changes, and an operator's
drain, which moves the worker's replicas elsewhere."""

from datetime import datetime

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from controlplane import live_events
from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.common.services import validated_save
from controlplane.fleet import commands, heartbeat_cache
from controlplane.fleet.models import Gpu, Replica, Worker
from controlplane.fleet.services.quality import quality_measurements_abandon
from controlplane.fleet.services.replicas import replica_transition_locked
from gpuworker.contract.heartbeat import ModelPaths, WorkerRegistration
from gpuworker.contract.tasks import DrainWorker


class WorkerUnknown(Exception):
    """A heartbeat named a worker id the control plane does not have; the daemon registers again."""


def publish_worker(worker: Worker) -> None:
    live_events.publish(
        group=live_events.FLEET_GROUP,
        event="worker.state",
        data={
            "worker_id": worker.pk,
            "name": worker.name,
            "state": worker.state,
        },
    )


def checkpoint_reports(models: ModelPaths | None) -> dict:
    """Worker.model_checkpoints for a reported scan: what was read at each found checkpoint."""
    return {path: report.to_json() for path, report in models.checkpoints} if models else {}


@transaction.atomic
def worker_register(*, registration: WorkerRegistration, now: datetime) -> Worker:
    """Create the worker, or update the one with this name (a restarted daemon), and set it online."""
    worker = Worker.objects.select_for_update(no_key=True).filter(name=registration.name).first()
    if worker is None:
        worker = Worker(name=registration.name, queue_name=f"gpuworker.{registration.name}")
    worker.advertise_host = registration.advertise_host
    worker.device = registration.device
    worker.cpu_memory_total_bytes = registration.cpu_memory_total_bytes
    worker.cpu_cores = registration.cpu_cores
    worker.version = registration.version
    worker.model_roots = list(registration.models.roots) if registration.models else []
    worker.model_paths = list(registration.models.paths) if registration.models else []
    worker.model_quantization = dict(registration.models.quantization) if registration.models else {}
    worker.model_checkpoints = checkpoint_reports(registration.models)
    worker.state = Worker.State.ONLINE
    worker.state_changed_at = now
    validated_save(worker)
    known = {gpu.index: gpu for gpu in Gpu.objects.select_for_update().filter(worker=worker)}
    for spec in registration.gpus:
        gpu = known.pop(spec.index, None) or Gpu(worker=worker, index=spec.index)
        gpu.name, gpu.memory_total_bytes, gpu.present = spec.name, spec.memory_total_bytes, True
        validated_save(gpu)
    Gpu.objects.filter(pk__in=[gpu.pk for gpu in known.values()]).update(present=False)
    quality_measurements_abandon(worker=worker, now=now)
    state = {"worker_id": worker.pk, "name": worker.name, "state": worker.state, "received_at": now.timestamp()}
    transaction.on_commit(lambda: heartbeat_cache.store(worker_id=worker.pk, state=state))
    publish_worker(worker)
    # New capacity: deployments waiting for room may fit now.
    commands.request_reconcile()
    return worker


def worker_set_state(*, worker: Worker, to_state: str, now: datetime) -> Worker:
    # Conditional on the state we read, so a concurrent change (lost marking, drain) wins cleanly.
    if Worker.objects.filter(pk=worker.pk, state=worker.state).update(state=to_state, state_changed_at=now):
        worker.state, worker.state_changed_at = to_state, now
        publish_worker(worker)
    return worker


@transaction.atomic
def worker_drain(*, worker: Worker, actor=None) -> Worker:
    """Stop placing on this worker and move its replicas elsewhere; the daemon finishes in-flight
    requests (up to FLEET_WORKER_DRAIN_TIMEOUT_SECONDS) and stops them."""
    worker = Worker.objects.select_for_update(no_key=True).get(pk=worker.pk)
    if worker.state != Worker.State.ONLINE:
        raise ValidationError(
            {"worker": f"Worker {worker.name} is {worker.state}; only an online worker can be drained."}
        )
    now = timezone.now()
    worker.state, worker.state_changed_at = Worker.State.DRAINING, now
    worker.save(update_fields=["state", "state_changed_at"])
    publish_worker(worker)
    replicas = list(
        Replica.objects.select_for_update(no_key=True)
        .filter(worker=worker, state__in=Replica.ACTIVE_STATES)
        .order_by("pk")
    )
    for replica in replicas:
        to_state = Replica.State.STOPPED if replica.state == Replica.State.PENDING else Replica.State.DRAINING
        replica_transition_locked(replica, to_state=to_state, at=now)
    commands.send_to_worker(
        queue=worker.queue_name, task=DrainWorker(timeout_s=float(settings.FLEET_WORKER_DRAIN_TIMEOUT_SECONDS))
    )
    audit_record(
        actor=actor,
        action=AuditEntry.Action.WORKER_DRAIN,
        target=worker,
        target_label=worker.name,
        detail={
            "state": [Worker.State.ONLINE, worker.state],
            "replicas_moved": [r.pk for r in replicas],
        },
    )
    if replicas:
        commands.request_reconcile(deployment_ids=[r.deployment_id for r in replicas])
    return worker
