"""The control loop's service: compare each deployment's desired replicas with its live ones,
place or drain the difference, and heal lost messages. Safe to run concurrently: the deployment
row, then the workers (for placement) and then replicas are locked, always in that order."""

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from controlplane.catalog.models import Deployment
from controlplane.fleet import heartbeat_cache
from controlplane.fleet.models import Gpu, Replica, Worker
from controlplane.fleet.placement import Candidate, choose_to_remove, plan_placements
from controlplane.fleet.selectors import placement_slots, workers_where_model_failed
from controlplane.fleet.services import replica_place, replica_stop, replica_transition


@dataclass(frozen=True)
class ReconcileOutcome:
    deployment_id: int
    placed: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    # Replicas wanted that found no worker with room (or only workers where the model failed).
    unplaced: int = 0


def fleet_reconcile(*, now: datetime, deployment_ids: list[int] | None = None) -> list[ReconcileOutcome]:
    replicas_fail_unacknowledged(now=now)
    if deployment_ids is None:
        deployment_ids = list(Deployment.objects.order_by("pk").values_list("pk", flat=True))
    outcomes = (deployment_reconcile(deployment_id=pk, now=now) for pk in deployment_ids)
    return [outcome for outcome in outcomes if outcome is not None]


def replicas_fail_unacknowledged(*, now: datetime) -> int:
    """Fail pending replicas whose worker never confirmed the load (the message was lost, or the
    worker consumed it and died): reconcile then places them again."""
    timeout = settings.FLEET_REPLICA_ACK_TIMEOUT_SECONDS
    stale = Replica.objects.filter(state=Replica.State.PENDING, state_changed_at__lt=now - timedelta(seconds=timeout))
    failed = 0
    for pk in stale.values_list("pk", flat=True):
        with transaction.atomic():
            replica = (Replica.objects.select_for_update(no_key=True, skip_locked=True).select_related("worker")
                       .filter(pk=pk, state=Replica.State.PENDING).first())
            if replica is not None:
                replica_transition(
                    replica=replica, to_state=Replica.State.FAILED, at=now, failure=Replica.Failure.NOT_ACKNOWLEDGED,
                    error=f"Worker {replica.worker.name} did not acknowledge the load within {timeout} s.",
                )
                failed += 1
    return failed


def _missing(deployment: Deployment) -> int:
    active = Replica.objects.filter(deployment=deployment, state__in=Replica.ACTIVE_STATES).count()
    return deployment.desired_replicas - active


def deployment_reconcile(*, deployment_id: int, now: datetime) -> ReconcileOutcome | None:
    deployment = Deployment.objects.filter(pk=deployment_id).first()
    if deployment is None:
        return None
    # Most passes find nothing to do: they take no lock and write nothing.
    if _missing(deployment) == 0:
        return ReconcileOutcome(deployment.pk)
    return _deployment_reconcile_locked(deployment_id=deployment_id, now=now)


@transaction.atomic
def _deployment_reconcile_locked(*, deployment_id: int, now: datetime) -> ReconcileOutcome | None:
    deployment = Deployment.objects.select_for_update().select_related("model").filter(pk=deployment_id).first()
    if deployment is None:
        return None
    missing = _missing(deployment)
    if missing > 0:
        placed = _scale_up(deployment, missing)
        return ReconcileOutcome(deployment.pk, placed=placed, unplaced=missing - len(placed))
    if missing < 0:
        return ReconcileOutcome(deployment.pk, removed=_scale_down(deployment, -missing, now))
    return ReconcileOutcome(deployment.pk)


def _scale_up(deployment: Deployment, count: int) -> list[int]:
    # Locking the online workers makes placement a critical section: two reconciles (of different
    # deployments) cannot both count the same free memory.
    excluded = workers_where_model_failed(deployment=deployment)
    workers = [w for w in Worker.objects.select_for_update(no_key=True).filter(state=Worker.State.ONLINE).order_by("pk")
               if w.pk not in excluded]
    if not workers:
        return []
    mine = list(Replica.objects.filter(deployment=deployment, state__in=Replica.LIVE_STATES).values_list("worker_id", "gpu_id"))
    chosen = plan_placements(
        slots=placement_slots(workers=workers), need_bytes=deployment.model.gpu_memory_bytes, count=count,
        replicas_per_worker=Counter(worker_id for worker_id, _ in mine), replicas_per_slot=Counter(mine),
    )
    by_id = {w.pk: w for w in workers}
    gpus = Gpu.objects.in_bulk([slot.gpu_id for slot in chosen if slot.gpu_id is not None])
    return [
        replica_place(deployment=deployment, worker=by_id[slot.worker_id], gpu=gpus.get(slot.gpu_id)).pk
        for slot in chosen
    ]


def _scale_down(deployment: Deployment, count: int, now: datetime) -> list[int]:
    replicas = list(Replica.objects.select_for_update(no_key=True).select_related("worker")
                    .filter(deployment=deployment, state__in=Replica.ACTIVE_STATES).order_by("pk"))
    latest = heartbeat_cache.read_many(worker_ids=list({r.worker_id for r in replicas}))

    def outstanding(replica: Replica) -> int:
        figures = (latest.get(replica.worker_id) or {}).get("replicas", {}).get(str(replica.pk), {})
        return int(figures.get("running", 0) + figures.get("waiting", 0))

    remove = set(choose_to_remove(candidates=[
        Candidate(replica_id=r.pk, state=r.state, created_at=r.created_at, outstanding_requests=outstanding(r))
        for r in replicas
    ], count=count))
    for replica in replicas:
        if replica.pk in remove:
            replica_stop(replica=replica, at=now)
    return sorted(remove)
