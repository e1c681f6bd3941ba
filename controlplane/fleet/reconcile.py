"""The control loop's service: compare each deployment's desired replicas with its live ones,
place or drain the difference, move replicas off crowded workers (fleet.rebalance), and heal lost
messages. Safe to run concurrently: the deployment
row, then the workers (for placement) and then replicas are locked, always in that order."""

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from controlplane.catalog.models import Deployment
from controlplane.catalog.selectors import quality_refusal
from controlplane.fleet.models import Gpu, PlacementReport, Replica, Worker
from controlplane.fleet.placement import (
    SlotRoom,
    choose_to_remove,
    held_places,
    plan_placements,
    room_message,
)
from controlplane.fleet.rebalance import rebalance_due, rebalance_moves_in_progress, rebalance_settle, rebalance_start
from controlplane.fleet.selectors import (
    backoff_note,
    live_replica_placements,
    load_backoffs,
    placement_slots,
    removal_candidates,
)
from controlplane.fleet.services.deployments import publish_deployment
from controlplane.fleet.services.replicas import (
    replica_place,
    replica_stop,
    replica_transition,
    slot_label,
    too_large_note,
)


@dataclass(frozen=True)
class ReconcileOutcome:
    deployment_id: int
    placed: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    # Replicas wanted that found no worker with room (or only workers backing off from the model),
    # and why: what it needs and what each online worker has free.
    unplaced: int = 0
    reason: str = ""


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
            replica = (
                Replica.objects.select_for_update(no_key=True, skip_locked=True)
                .select_related("worker")
                .filter(pk=pk, state=Replica.State.PENDING)
                .first()
            )
            if replica is not None:
                replica_transition(
                    replica=replica,
                    to_state=Replica.State.FAILED,
                    at=now,
                    failure=Replica.Failure.NOT_ACKNOWLEDGED,
                    error=f"Worker {replica.worker.name} did not acknowledge the load within {timeout} s.",
                )
                failed += 1
    return failed


def wanted_replicas(deployment: Deployment) -> int:
    """The replicas reconcile keeps: none while the model is disabled (its desired count is kept,
    so enabling it again brings them back)."""
    return deployment.desired_replicas if deployment.model.enabled else 0


def _missing(deployment: Deployment) -> int:
    """Replicas to place (negative: to remove). A replacement being started by a rebalancing move
    is one above the desired count, and counts neither way."""
    active = Replica.objects.filter(deployment=deployment, state__in=Replica.ACTIVE_STATES).count()
    return wanted_replicas(deployment) - active + rebalance_moves_in_progress(deployment=deployment)


def deployment_reconcile(*, deployment_id: int, now: datetime) -> ReconcileOutcome | None:
    deployment = Deployment.objects.select_related("model").filter(pk=deployment_id).first()
    if deployment is None:
        return None
    # Most passes find nothing to do: they take no lock and write nothing.
    wanted = wanted_replicas(deployment)
    if _missing(deployment) == 0 and not rebalance_due(deployment=deployment, wanted=wanted, now=now):
        return ReconcileOutcome(deployment.pk)
    return _deployment_reconcile_locked(deployment_id=deployment_id, now=now)


@transaction.atomic
def _deployment_reconcile_locked(*, deployment_id: int, now: datetime) -> ReconcileOutcome | None:
    deployment = Deployment.objects.select_for_update().select_related("model").filter(pk=deployment_id).first()
    if deployment is None:
        return None
    wanted = wanted_replicas(deployment)
    move = rebalance_settle(deployment=deployment, wanted=wanted, now=now)
    drained = [move.drained_replica_id] if move is not None and move.drained_replica_id else []
    missing = _missing(deployment)
    if missing > 0:
        placed, reason = _scale_up(deployment, missing, now)
        outcome = ReconcileOutcome(
            deployment.pk,
            placed=placed,
            removed=drained,
            unplaced=missing - len(placed),
            reason=reason if len(placed) < missing else "",
        )
        _placement_report_record(deployment, outcome, now)
        return outcome
    if missing < 0:
        return ReconcileOutcome(deployment.pk, removed=drained + _scale_down(deployment, -missing, now))
    started = rebalance_start(deployment=deployment, wanted=wanted, now=now)
    return ReconcileOutcome(deployment.pk, placed=[started.replica_id] if started else [], removed=drained)


def _scale_up(deployment: Deployment, count: int, now: datetime) -> tuple[list[int], str]:
    """Place up to `count` replicas; returns their ids and, for the ones that found no place, why.
    A deployment whose model misses its quality bar (catalog.selectors.quality_refusal) places none."""
    refusal = quality_refusal(deployment=deployment)
    if refusal:
        return [], refusal
    # Locking the online workers makes placement a critical section: two reconciles (of different
    # deployments) cannot both count the same free memory.
    workers = list(Worker.objects.select_for_update(no_key=True).filter(state=Worker.State.ONLINE).order_by("pk"))
    backoffs = {b.worker_id: b for b in load_backoffs(deployment_ids=[deployment.pk])}
    # A worker where the model failed lately waits out its backoff; after it, it is tried again,
    # but after workers where the model has not failed.
    waiting = {worker_id for worker_id, b in backoffs.items() if b.next_attempt_at > now}
    slots = placement_slots(workers=workers)
    model = deployment.model
    need, size = model.gpu_memory_bytes, model.tensor_parallel_size
    mine = live_replica_placements(worker_ids=[w.pk for w in workers], deployment_id=deployment.pk)
    chosen = plan_placements(
        slots=[slot for slot in slots if slot.worker_id not in waiting],
        need_bytes=need,
        count=count,
        replicas_per_worker=Counter(worker_id for worker_id, *_ in mine),
        replicas_per_slot=Counter(
            (worker_id, index)
            for worker_id, first, held, _ in mine
            for index in held_places(first_index=first, tensor_parallel_size=held)
        ),
        failures_per_worker=Counter({worker_id: b.consecutive_failures for worker_id, b in backoffs.items()}),
        tensor_parallel_size=size,
    )
    by_id = {w.pk: w for w in workers}
    gpus = Gpu.objects.in_bulk([slot.gpu_id for slot in slots if slot.gpu_id is not None])
    placed = [
        replica_place(deployment=deployment, worker=by_id[group[0].worker_id], gpu=gpus.get(group[0].gpu_id)).pk
        for group in chosen
    ]
    if len(placed) == count:
        return placed, ""
    # The slots now count the replicas just placed: the free memory left, as the next one sees it.
    rooms = [
        SlotRoom(
            label=slot_label(worker=by_id[slot.worker_id], gpu=gpus.get(slot.gpu_id)),
            free_bytes=slot.free_bytes,
            total_bytes=slot.total_bytes,
            note=slot.taken_by
            or (backoff_note(backoffs[slot.worker_id], now=now) if slot.worker_id in waiting else ""),
        )
        for slot in slots
    ]
    reason = room_message(need_bytes=need, rooms=rooms, tensor_parallel_size=size)
    gpu_sizes = [slot.total_bytes for slot in slots if slot.gpu_id is not None]
    note = too_large_note(model=model, gpu_bytes=max(gpu_sizes)) if gpu_sizes else ""
    return placed, f"{reason}. {note}" if note else reason


def _placement_report_record(deployment: Deployment, outcome: ReconcileOutcome, now: datetime) -> None:
    """Keep why the deployment is short of places for the pages; written only when that changes."""
    report = PlacementReport.objects.filter(deployment=deployment).first()
    if report is not None and (report.unplaced, report.reason) == (outcome.unplaced, outcome.reason):
        return
    if report is None and not outcome.unplaced:
        return
    PlacementReport.objects.update_or_create(
        deployment=deployment, defaults={"unplaced": outcome.unplaced, "reason": outcome.reason, "at": now}
    )
    publish_deployment(deployment)


def _scale_down(deployment: Deployment, count: int, now: datetime) -> list[int]:
    replicas = list(
        Replica.objects.select_for_update(no_key=True)
        .select_related("worker")
        .filter(deployment=deployment, state__in=Replica.ACTIVE_STATES)
        .order_by("pk")
    )
    remove = set(choose_to_remove(candidates=removal_candidates(replicas=replicas), count=count))
    for replica in replicas:
        if replica.pk in remove:
            replica_stop(replica=replica, at=now)
    return sorted(remove)
