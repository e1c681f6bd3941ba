"""Rebalancing, a step of the control loop (reconcile): moving running replicas of a deployment off a
worker that holds more than one of them, so one worker going away cannot take them all.

Placement spreads new replicas over workers, but a replica replaced while a worker was away lands
beside the others, and nothing else moves it back when that worker returns. The rule:

- A deployment that wants at least two replicas, all of them ready (none starting or draining:
  not while it scales), none of its loads backing off or degraded, and whose last move finished
  more than FLEET_REBALANCE_COOLDOWN_SECONDS ago (so replicas do not flap), is looked at.
- When one worker holds more of its replicas than any other, at least two, and an online worker
  holding at least two fewer has room (placement.plan_rebalance: the same room rule as placement),
  a replacement is started there first, and the move is recorded (RebalanceMove) and audited.
- While it loads, reconcile counts it as one replica above the desired count (no scale-down takes
  it, no second move starts). Once it is ready, and the ready replicas without one on the crowded
  worker still number the desired count, the least busy ready replica there is drained through the
  ordinary unload path (replica_stop: in-flight requests finish).
- If the replacement fails or is stopped first, the crowded worker keeps its replicas (the failed
  load backs off as any other); if the crowded worker no longer has one to spare (it was lost, an
  operator unloaded one), the move is abandoned and the replacement is an ordinary replica.

Each start and end is audited (`replica.move`) and the fleet page's deployment status says which
move is under way.
"""

from collections import Counter
from datetime import datetime, timedelta

from django.conf import settings

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.catalog.models import Deployment
from controlplane.catalog.selectors import quality_refusal
from controlplane.fleet.models import Gpu, RebalanceMove, Replica, Worker
from controlplane.fleet.placement import choose_to_remove, held_places, plan_rebalance
from controlplane.fleet.selectors import live_replica_placements, load_backoffs, placement_slots, removal_candidates
from controlplane.fleet.services.deployments import publish_deployment
from controlplane.fleet.services.replicas import replica_place, replica_stop


def rebalance_moves_in_progress(*, deployment: Deployment) -> int:
    """1 while a replacement is being started elsewhere: the replica the deployment has above its desired ones."""
    return RebalanceMove.objects.filter(deployment=deployment, state=RebalanceMove.State.MOVING).count()


def rebalance_due(*, deployment: Deployment, wanted: int, now: datetime) -> bool:
    """Whether reconcile should take the deployment's lock to settle or start a move: a cheap look,
    without locks; rebalance_settle and rebalance_start decide."""
    if rebalance_moves_in_progress(deployment=deployment):
        return True
    per_worker = _ready_per_worker(deployment, wanted)
    if per_worker is None or _cooling_down(deployment, now):
        return False
    most = max(per_worker.values())
    crowded = [worker_id for worker_id, count in per_worker.items() if count > most - 2]
    return most >= 2 and Worker.objects.filter(state=Worker.State.ONLINE).exclude(pk__in=crowded).exists()


def rebalance_settle(*, deployment: Deployment, wanted: int, now: datetime) -> RebalanceMove | None:
    """Advance the deployment's move in progress (the deployment row locked by the caller): drain
    the extra replica once its replacement is ready, or end the move. The move, or None."""
    move = (
        RebalanceMove.objects.select_for_update()
        .select_related("replica", "from_worker", "to_worker")
        .filter(deployment=deployment, state=RebalanceMove.State.MOVING)
        .first()
    )
    if move is None:
        return None
    replacement = move.replica
    replacement.refresh_from_db(fields=["state"])
    if replacement.state not in Replica.ACTIVE_STATES:
        return _finish(move, RebalanceMove.State.FAILED, now)
    spare = list(
        Replica.objects.select_for_update(no_key=True)
        .select_related("worker")
        .filter(deployment=deployment, worker=move.from_worker, state=Replica.State.READY)
        .order_by("pk")
    )
    if len(spare) < 2:
        return _finish(move, RebalanceMove.State.ABANDONED, now)
    ready = Replica.objects.filter(deployment=deployment, state=Replica.State.READY).count()
    if replacement.state != Replica.State.READY or ready - 1 < wanted:
        return move
    [drain_id] = choose_to_remove(candidates=removal_candidates(replicas=spare), count=1)
    move.drained_replica = replica_stop(replica=next(r for r in spare if r.pk == drain_id), at=now)
    return _finish(move, RebalanceMove.State.MOVED, now)


def rebalance_start(*, deployment: Deployment, wanted: int, now: datetime) -> RebalanceMove | None:
    """Start one move if the rule (module docstring) asks for one; the deployment row locked by the caller."""
    per_worker = _ready_per_worker(deployment, wanted)
    if per_worker is None or _cooling_down(deployment, now) or _held_back(deployment, now):
        return None
    # Locked as reconcile's placement locks them: no other placement counts the same free memory.
    workers = list(Worker.objects.select_for_update(no_key=True).filter(state=Worker.State.ONLINE).order_by("pk"))
    mine = live_replica_placements(worker_ids=[w.pk for w in workers], deployment_id=deployment.pk)
    model = deployment.model
    plan = plan_rebalance(
        slots=placement_slots(workers=workers),
        need_bytes=model.gpu_memory_bytes,
        replicas_per_worker=per_worker,
        replicas_per_slot=Counter(
            (worker_id, index)
            for worker_id, first, held, _ in mine
            for index in held_places(first_index=first, tensor_parallel_size=held)
        ),
        tensor_parallel_size=model.tensor_parallel_size,
    )
    if plan is None:
        return None
    from_worker_id, group = plan
    to_worker = next(w for w in workers if w.pk == group[0].worker_id)
    gpu = Gpu.objects.filter(pk=group[0].gpu_id).first() if group[0].gpu_id is not None else None
    replica = replica_place(deployment=deployment, worker=to_worker, gpu=gpu)
    move = RebalanceMove.objects.create(
        deployment=deployment,
        from_worker=Worker.objects.get(pk=from_worker_id),
        to_worker=to_worker,
        replica=replica,
        started_at=now,
    )
    _audit(move, detail={"replicas_per_worker": _named_counts(per_worker)})
    publish_deployment(deployment)
    return move


def _ready_per_worker(deployment: Deployment, wanted: int) -> Counter | None:
    """Its replicas per worker when the deployment may be rebalanced: at least two wanted and
    exactly that many live, all ready; None otherwise (it scales, or is too small to spread)."""
    if wanted < 2:
        return None
    rows = list(
        Replica.objects.filter(deployment=deployment, state__in=Replica.LIVE_STATES).values_list("worker_id", "state")
    )
    if len(rows) != wanted or any(state != Replica.State.READY for _, state in rows):
        return None
    return Counter(worker_id for worker_id, _ in rows)


def _cooling_down(deployment: Deployment, now: datetime) -> bool:
    since = now - timedelta(seconds=settings.FLEET_REBALANCE_COOLDOWN_SECONDS)
    return RebalanceMove.objects.filter(deployment=deployment, finished_at__gt=since).exists()


def _held_back(deployment: Deployment, now: datetime) -> bool:
    """Loads of the deployment back off (or it is degraded), or its model misses its quality bar."""
    backoffs = list(load_backoffs(deployment_ids=[deployment.pk]))
    failed = sum(b.consecutive_failures for b in backoffs)
    if any(b.next_attempt_at > now for b in backoffs) or failed >= settings.FLEET_LOAD_DEGRADED_AFTER_FAILURES:
        return True
    return bool(quality_refusal(deployment=deployment))


def _finish(move: RebalanceMove, state: str, now: datetime) -> RebalanceMove:
    move.state, move.finished_at = state, now
    move.save(update_fields=["state", "finished_at", "drained_replica"])
    _audit(move, detail={"drained_replica": move.drained_replica_id})
    publish_deployment(move.deployment)
    return move


def _audit(move: RebalanceMove, *, detail: dict) -> None:
    name = move.deployment.model.public_name
    audit_record(
        actor=None,
        action=AuditEntry.Action.REPLICA_MOVE,
        target=move.replica,
        target_label=f"{name} replica {move.replica_id} on {move.to_worker.name}",
        detail={
            "model": name,
            "from_worker": move.from_worker.name,
            "to_worker": move.to_worker.name,
            "state": move.state,
            **detail,
        },
    )


def _named_counts(per_worker: Counter) -> dict[str, int]:
    names = dict(Worker.objects.filter(pk__in=list(per_worker)).values_list("pk", "name"))
    return {names[worker_id]: count for worker_id, count in sorted(per_worker.items())}
