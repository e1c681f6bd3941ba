"""Replicas: the state machine every change goes through, placement (a pending replica and its load
message), stopping, and the operators' load and unload, which want one replica more or fewer."""

from datetime import datetime

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from controlplane import live_events
from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.catalog.services import model_gpu_need
from controlplane.common.services import validated_save
from controlplane.fleet import commands
from controlplane.fleet.backoff import next_attempt_at
from controlplane.fleet.models import Gpu, LoadBackoff, Replica, Worker
from controlplane.fleet.placement import (
    SlotRoom,
    group_fits,
    memory_fraction,
    room_message,
    share_bytes,
    slot_groups,
)
from controlplane.fleet.selectors import placement_slots
from controlplane.fleet.services.deployments import deployment_lock, deployment_set_desired_replicas, publish_deployment
from gpuworker.contract.placement import UNSPLIT_QUANTIZATIONS, gpu_share_bytes
from gpuworker.contract.tasks import LoadModel, UnloadModel


def replica_transition_locked(
    replica: Replica,
    *,
    to_state: str,
    at: datetime,
    endpoint_url: str | None = None,
    error: str = "",
    failure: str = "",
) -> Replica:
    """Move a replica (already locked by the caller) one legal step along its state machine."""
    if to_state not in Replica.State.values:
        raise ValidationError({"state": f"Unknown replica state {to_state!r}."})
    if to_state not in Replica.TRANSITIONS[replica.state]:
        raise ValidationError({"state": f"A replica cannot go from {replica.state} to {to_state}."})
    replica.state = to_state
    replica.state_changed_at = at
    if endpoint_url is not None:
        replica.endpoint_url = endpoint_url
    if to_state == Replica.State.FAILED:
        replica.last_error, replica.failure = error, failure
    validated_save(replica)
    # The backoff moves in the same transaction as the replica, so the two never disagree.
    if to_state == Replica.State.FAILED and failure == Replica.Failure.LOAD:
        _load_backoff_record(replica, at=at)
    elif to_state == Replica.State.READY:
        LoadBackoff.objects.filter(deployment_id=replica.deployment_id, worker_id=replica.worker_id).delete()
    publish_replica(replica)
    return replica


def _load_backoff_record(replica: Replica, *, at: datetime) -> LoadBackoff:
    """One more failed load of the replica's deployment on its worker: leave that worker out until
    the next attempt's time (FLEET_LOAD_RETRY_*), keeping the error."""
    backoff, _ = LoadBackoff.objects.get_or_create(
        deployment_id=replica.deployment_id,
        worker_id=replica.worker_id,
        defaults={"first_failed_at": at, "last_failed_at": at, "next_attempt_at": at},
    )
    backoff = LoadBackoff.objects.select_for_update().select_related("deployment__model").get(pk=backoff.pk)
    if backoff.consecutive_failures and backoff.last_failed_at < backoff.deployment.model.updated_at:
        # Failures of the model as it was before its last edit do not count against it now.
        backoff.consecutive_failures, backoff.first_failed_at = 0, at
    backoff.consecutive_failures += 1
    backoff.last_failed_at, backoff.last_error = at, replica.last_error
    backoff.next_attempt_at = next_attempt_at(
        failed_at=at,
        consecutive_failures=backoff.consecutive_failures,
        initial_seconds=settings.FLEET_LOAD_RETRY_INITIAL_SECONDS,
        max_seconds=settings.FLEET_LOAD_RETRY_MAX_SECONDS,
    )
    backoff.save()
    return backoff


def publish_replica(replica: Replica) -> None:
    live_events.publish(
        group=live_events.FLEET_GROUP,
        event="replica.state",
        data={
            "replica_id": replica.pk,
            "deployment_id": replica.deployment_id,
            "worker_id": replica.worker_id,
            "state": replica.state,
            "endpoint_url": replica.endpoint_url,
            "error": replica.last_error,
        },
    )


@transaction.atomic
def replica_transition(
    *,
    replica: Replica,
    to_state: str,
    at: datetime,
    endpoint_url: str | None = None,
    error: str = "",
    failure: str = "",
) -> Replica:
    """Move a replica along its state machine; an illegal move raises ValidationError and writes nothing."""
    # Lock the row: a heartbeat and a reconcile task may move the same replica concurrently.
    replica = Replica.objects.select_for_update(no_key=True).get(pk=replica.pk)
    return replica_transition_locked(
        replica, to_state=to_state, at=at, endpoint_url=endpoint_url, error=error, failure=failure
    )


@transaction.atomic
def replica_place(*, deployment, worker: Worker, gpu: Gpu | None) -> Replica:
    """Create a pending replica and send the worker its load message (after commit). `gpu`: the
    first of its GPUs when the model is split over several (tensor_parallel_size)."""
    model = deployment.model
    size = model.tensor_parallel_size
    replica = validated_save(
        Replica(deployment=deployment, worker=worker, gpu=gpu, state=Replica.State.PENDING, tensor_parallel_size=size)
    )
    publish_replica(replica)  # the fleet page shows the new replica at once, before it loads
    need = share_bytes(need_bytes=model.gpu_memory_bytes, on_gpu=gpu is not None, tensor_parallel_size=size)
    total = gpu.memory_total_bytes if gpu is not None else worker.cpu_memory_total_bytes
    commands.send_to_worker(
        queue=worker.queue_name,
        task=LoadModel(
            replica_id=replica.pk,
            model_path=model.weights_path,
            served_model_name=model.public_name,
            gpu_index=gpu.index if gpu is not None else None,
            memory_fraction=memory_fraction(need_bytes=need, total_bytes=total),
            max_model_len=model.served_context_length,
            allow_long_context=model.allow_long_context,
            tensor_parallel_size=size,
            expert_parallel=model.expert_parallel,
            max_images_per_request=model.max_images_per_request,
            max_image_bytes=model.max_image_bytes,
            max_image_pixels=model.max_image_pixels,
            low_detail_pixels=model.low_detail_pixels,
            quantization=model.load_quantization,
        ),
    )
    return replica


def replica_stop(*, replica: Replica, at: datetime) -> Replica:
    """Take a locked, active replica out of service: a pending one stops at once, others drain.
    The unload message goes either way, in case the load message is still on its way."""
    to_state = Replica.State.STOPPED if replica.state == Replica.State.PENDING else Replica.State.DRAINING
    replica_transition_locked(replica, to_state=to_state, at=at)
    commands.send_to_worker(
        queue=replica.worker.queue_name,
        task=UnloadModel(replica_id=replica.pk, drain_timeout_s=float(settings.FLEET_UNLOAD_DRAIN_TIMEOUT_SECONDS)),
    )
    return replica


def too_large_note(*, model, gpu_bytes: int) -> str:
    """Why no tensor_parallel_size empty GPUs of `gpu_bytes` each can hold `model`, with the GPUs it
    would need (catalog.services.model_gpu_need), e.g. "deepseek-v3 needs 8 GPUs of 131.3 GiB in
    FP8, 16 in bf16; its tensor_parallel_size is 1: set it to 8 (...)"; "" when they can."""
    size = model.tensor_parallel_size
    if gpu_share_bytes(need_bytes=model.gpu_memory_bytes, tensor_parallel_size=size) <= gpu_bytes:
        return ""
    need = model_gpu_need(model=model, gpu_bytes=gpu_bytes)
    note = f"{model.public_name} {need.text}; its tensor_parallel_size is {size}"
    if model.quantization in UNSPLIT_QUANTIZATIONS:
        return f"{note}, and its {model.get_quantization_display()} checkpoint runs on one GPU: it needs a larger GPU"
    if need.as_sized is None:
        return f"{note}, and it needs more GPUs of this size than one worker holds"
    return f"{note}: set it to {need.as_sized} (its heads and experts must divide by it) on workers with as many GPUs"


def slot_label(*, worker: Worker, gpu: Gpu | None) -> str:
    """Where a replica runs, as messages name it: "worker-a GPU 0 (NVIDIA H200)" or "worker-a CPU"."""
    return f"{worker.name} GPU {gpu.index} ({gpu.name})" if gpu is not None else f"{worker.name} CPU"


@transaction.atomic
def replica_load_on(*, deployment, worker: Worker, gpu: Gpu | None, actor=None) -> Replica:
    """Put one more replica of `deployment` on this worker's GPU (None on a CPU-only worker; the
    first of its GPUs for a model split over several).
    Allowed where the model failed before: unlike reconcile's retries, this is a person's choice."""
    deployment = deployment_lock(deployment)
    worker = Worker.objects.select_for_update(no_key=True).get(pk=worker.pk)
    model = deployment.model
    if not model.enabled:
        # Reconcile keeps no replica of a disabled model: it would drain this one at once.
        raise ValidationError({"deployment": f"{model.public_name} is disabled: enable it in the catalog first."})
    if worker.state != Worker.State.ONLINE:
        raise ValidationError(
            {"worker": f"Worker {worker.name} is {worker.state}; only an online worker takes new replicas."}
        )
    slots = placement_slots(workers=[worker])
    if gpu is None and not any(slot.gpu_id is None for slot in slots):
        raise ValidationError({"gpu": f"Worker {worker.name} has GPUs: choose one."})
    if gpu is not None and gpu.pk not in {slot.gpu_id for slot in slots}:
        raise ValidationError({"gpu": f"GPU {gpu.index} ({gpu.name}) is not a present GPU of worker {worker.name}."})
    size = model.tensor_parallel_size
    first = gpu.index if gpu is not None else None
    group = next((g for g in slot_groups(slots, size) if g[0].gpu_index == first), None)
    if group is None:
        last = first + size - 1
        raise ValidationError(
            {
                "gpu": f"{model.public_name} is split over {size} GPUs: from GPU {first} it needs "
                f"GPUs {first}–{last} of {worker.name}, and not all of them are present."
            }
        )
    if not group_fits(group, need_bytes=model.gpu_memory_bytes, tensor_parallel_size=size):
        gpus = Gpu.objects.in_bulk([slot.gpu_id for slot in group if slot.gpu_id is not None])
        rooms = [
            SlotRoom(
                label=slot_label(worker=worker, gpu=gpus.get(slot.gpu_id)),
                free_bytes=slot.free_bytes,
                total_bytes=slot.total_bytes,
                note=slot.taken_by,
            )
            for slot in group
        ]
        room = room_message(need_bytes=model.gpu_memory_bytes, rooms=rooms, tensor_parallel_size=size)
        note = too_large_note(model=model, gpu_bytes=min(slot.total_bytes for slot in group)) if gpu else ""
        raise ValidationError({"gpu": f"{model.public_name} does not fit: {room}" + (f". {note}." if note else ".")})
    # One more wanted, so reconcile keeps this replica instead of draining it as surplus.
    before = deployment_set_desired_replicas(
        deployment=deployment,
        desired_replicas=deployment.desired_replicas + 1,
        now=timezone.now(),
        field="deployment",
        refusal=f"{model.public_name} already wants {deployment.desired_replicas} replicas, "
        f"its max_replicas ({deployment.max_replicas}); raise it first.",
    )
    replica = replica_place(deployment=deployment, worker=worker, gpu=gpu)
    publish_deployment(deployment)
    audit_record(
        actor=actor,
        action=AuditEntry.Action.REPLICA_LOAD,
        target=replica,
        target_label=f"{model.public_name} replica {replica.pk} on {worker.name}",
        detail={
            "model": model.public_name,
            "worker": worker.name,
            "gpu_index": gpu.index if gpu is not None else None,
            "desired_replicas": [before, deployment.desired_replicas],
        },
    )
    return replica


@transaction.atomic
def replica_unload(*, replica: Replica, actor=None) -> Replica:
    """Drain and stop this replica, and want one replica fewer so reconcile does not replace it."""
    deployment = deployment_lock(replica.deployment)
    replica = Replica.objects.select_for_update(no_key=True).select_related("worker").get(pk=replica.pk)
    if replica.state not in Replica.ACTIVE_STATES:
        raise ValidationError(
            {
                "replica": f"Replica {replica.pk} is {replica.state}; only a pending, loading "
                f"or ready replica can be unloaded."
            }
        )
    # One fewer wanted, so reconcile does not replace it.
    before = deployment_set_desired_replicas(
        deployment=deployment,
        desired_replicas=deployment.desired_replicas - 1,
        now=timezone.now(),
        field="replica",
        refusal=f"{deployment.model.public_name} must keep at least {deployment.min_replicas} "
        f"replicas (min_replicas); lower it first.",
    )
    was = replica.state
    replica = replica_stop(replica=replica, at=timezone.now())
    publish_deployment(deployment)
    audit_record(
        actor=actor,
        action=AuditEntry.Action.REPLICA_UNLOAD,
        target=replica,
        target_label=f"{deployment.model.public_name} replica {replica.pk} on {replica.worker.name}",
        detail={
            "model": deployment.model.public_name,
            "worker": replica.worker.name,
            "state": [was, replica.state],
            "desired_replicas": [before, deployment.desired_replicas],
        },
    )
    return replica
