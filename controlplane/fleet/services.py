"""Writes for the fleet: worker registration and heartbeats, replica creation and state changes."""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.core.exceptions import ValidationError
from django.db import transaction

from controlplane.fleet.models import Gpu, Replica, Worker
from controlplane.tokens import new_secret_token, secret_hash


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as a worker reports it when registering."""

    index: int
    name: str
    memory_total_bytes: int


@dataclass(frozen=True)
class WorkerRegistered:
    """The new worker and its token, which is shown this once; only its hash is stored."""

    worker: Worker
    token: str


@transaction.atomic
def worker_register(*, host: str, queue_name: str, gpus: Sequence[GpuSpec], at: datetime) -> WorkerRegistered:
    token = new_secret_token()
    worker = Worker(
        host=host, queue_name=queue_name, token_hash=secret_hash(token),
        state=Worker.State.ONLINE, last_heartbeat_at=at,
    )
    worker.full_clean()
    worker.save()
    for spec in gpus:
        gpu = Gpu(worker=worker, index=spec.index, name=spec.name, memory_total_bytes=spec.memory_total_bytes)
        gpu.full_clean()
        gpu.save()
    return WorkerRegistered(worker=worker, token=token)


@transaction.atomic
def worker_record_heartbeat(*, worker: Worker, at: datetime) -> Worker:
    worker.last_heartbeat_at = at
    worker.state = Worker.State.ONLINE
    worker.save(update_fields=["last_heartbeat_at", "state"])
    return worker


@transaction.atomic
def workers_mark_stale(*, now: datetime, timeout: timedelta) -> int:
    """Mark online workers whose last heartbeat is older than `timeout` offline; returns how many."""
    return Worker.objects.filter(
        state=Worker.State.ONLINE, last_heartbeat_at__lt=now - timeout
    ).update(state=Worker.State.OFFLINE)


@transaction.atomic
def replica_create(*, deployment, worker: Worker, gpu: Gpu | None = None) -> Replica:
    replica = Replica(deployment=deployment, worker=worker, gpu=gpu, state=Replica.State.PENDING)
    replica.full_clean()
    replica.save()
    return replica


@transaction.atomic
def replica_transition(
    *, replica: Replica, to_state: str, at: datetime, endpoint_url: str | None = None, error: str = ""
) -> Replica:
    """Move a replica along its state machine; an illegal move raises ValidationError and writes nothing."""
    # Lock the row: a heartbeat and a reconcile task may move the same replica concurrently.
    replica = Replica.objects.select_for_update().get(pk=replica.pk)
    if to_state not in Replica.State.values:
        raise ValidationError({"state": f"Unknown replica state {to_state!r}."})
    if to_state not in Replica.TRANSITIONS[replica.state]:
        raise ValidationError(
            {"state": f"A replica cannot go from {replica.state} to {to_state}."}
        )
    replica.state = to_state
    replica.state_changed_at = at
    if endpoint_url is not None:
        replica.endpoint_url = endpoint_url
    if to_state == Replica.State.FAILED:
        replica.last_error = error
    replica.full_clean()
    replica.save()
    return replica
