"""Heartbeats and their absence: each heartbeat's live figures go to the cache and its replica
state changes to the database; the lost-worker judge fails the replicas of a worker that stopped
sending them (and whose replicas do not answer)."""

import logging
from dataclasses import replace
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from controlplane import live_events
from controlplane.fleet import commands, heartbeat_cache
from controlplane.fleet.heartbeat import FAILED, STOPPED, HeartbeatPlan, RecordedReplica, plan_heartbeat
from controlplane.fleet.lost_watch import Watch, watch_resume
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.replica_probe import any_replica_answers
from controlplane.fleet.selectors import worker_replica_endpoints, worker_silence_seconds
from controlplane.fleet.services.replicas import replica_transition_locked
from controlplane.fleet.services.workers import WorkerUnknown, checkpoint_reports, publish_worker, worker_set_state
from gpuworker.contract.heartbeat import Heartbeat

logger = logging.getLogger(__name__)


def worker_heartbeat(*, worker_id: int, heartbeat: Heartbeat, now: datetime) -> list[int]:
    """Record one heartbeat: live figures to the cache, state changes to the database. Returns the
    replica ids the worker should unload (ones it runs that the control plane wants gone)."""
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise WorkerUnknown(f"No worker with id {worker_id}; register again.")
    State = Worker.State
    if worker.state in (State.LOST, State.OFFLINE) or (worker.state == State.ONLINE and heartbeat.draining):
        worker_set_state(worker=worker, to_state=State.DRAINING if heartbeat.draining else State.ONLINE, now=now)
    if heartbeat.models is not None:
        Worker.objects.filter(pk=worker_id).update(
            model_roots=list(heartbeat.models.roots),
            model_paths=list(heartbeat.models.paths),
            model_quantization=dict(heartbeat.models.quantization),
            model_checkpoints=checkpoint_reports(heartbeat.models),
        )
    plan = plan_heartbeat(recorded=_recorded_replicas(worker_id, heartbeat), reported=list(heartbeat.replicas))
    if plan.steps:
        plan = _apply_heartbeat(worker_id=worker_id, heartbeat=heartbeat, now=now)
    state = {
        "worker_id": worker.pk,
        "name": worker.name,
        "state": worker.state,
        "received_at": now.timestamp(),
        "sent_at": heartbeat.sent_at,
        "draining": heartbeat.draining,
        "gpus": list(heartbeat.gpus),
        "cpu": heartbeat.cpu,
        "replicas": {
            str(r.replica_id): {
                "state": r.state,
                "endpoint_url": r.endpoint_url,
                "error": r.error,
                "pid": r.pid,
                **r.figures,
                "prefix_keys": list(r.prefix_keys),
                # Each tenant's share of the replica's recent service (the fleet page shows it).
                "tenant_shares": r.tenant_shares,
            }
            for r in heartbeat.replicas
        },
        # What the worker keeps warm for fast loads (controlplane/fleet/staging.py decides it).
        "staging": heartbeat.staging.to_json() if heartbeat.staging is not None else None,
    }
    heartbeat_cache.store(worker_id=worker.pk, state=state)
    heartbeat_cache.store_figures(
        worker_id=worker.pk, figures={"received_at": state["received_at"], "gpus": state["gpus"], "cpu": state["cpu"]}
    )
    live_events.publish(group=live_events.FLEET_GROUP, event="worker.heartbeat", data=state)
    return plan.unload


def _recorded_replicas(worker_id: int, heartbeat: Heartbeat, *, lock: bool = False) -> list[RecordedReplica]:
    reported_ids = [report.replica_id for report in heartbeat.replicas]
    rows = Replica.objects.filter(worker_id=worker_id).filter(Q(state__in=Replica.LIVE_STATES) | Q(pk__in=reported_ids))
    if lock:
        rows = rows.select_for_update(no_key=True).order_by("pk")
    return [RecordedReplica(replica_id=pk, state=state) for pk, state in rows.values_list("pk", "state")]


@transaction.atomic
def _apply_heartbeat(*, worker_id: int, heartbeat: Heartbeat, now: datetime) -> HeartbeatPlan:
    # Planned again under row locks: reconcile or an operator may have moved a replica meanwhile.
    plan = plan_heartbeat(
        recorded=_recorded_replicas(worker_id, heartbeat, lock=True), reported=list(heartbeat.replicas)
    )
    replicas = Replica.objects.select_related("worker", "deployment__model").in_bulk([s.replica_id for s in plan.steps])
    ended = set()
    for step in plan.steps:
        replica = replicas[step.replica_id]
        for to_state in step.path:
            replica_transition_locked(
                replica,
                to_state=to_state,
                at=now,
                endpoint_url=step.endpoint_url,
                error=step.error,
                failure=step.failure,
            )
        if replica.state in (FAILED, STOPPED):
            ended.add(replica.deployment_id)
    if ended:
        commands.request_reconcile(deployment_ids=list(ended))
    return plan


def workers_mark_lost(*, now: datetime) -> int:
    """The lost-worker judge (beat, every second). A worker silent for FLEET_WORKER_LOST_AFTER_SECONDS
    of watched time whose replicas do not answer is lost and its live replicas failed (a drained
    one just goes offline); lost ones silent much longer go offline.

    Silence counts only over the judge's unbroken watch (lost_watch.py): after the database, the
    cache, the broker or Celery kept the check from running, or the cache came back empty, every
    worker has a whole lost window again. A silent worker whose replicas answer their /health
    (replica_probe.py) runs: its heartbeats go unrecorded (the control plane too busy, or unable
    to write them), so it is held, not lost, and the log and /metrics say so."""
    State = Worker.State
    lost_after = settings.FLEET_WORKER_LOST_AFTER_SECONDS
    workers = list(Worker.objects.filter(state__in=[State.ONLINE, State.DRAINING, State.LOST]))
    latest = heartbeat_cache.read_many(worker_ids=[w.pk for w in workers])
    at = now.timestamp()
    watch, restarted = watch_resume(Watch.from_json(heartbeat_cache.lost_watch()), now=at, max_gap_s=lost_after)
    if restarted:
        logger.warning(
            "lost-worker judgement paused: %s; silence counts from now, so no worker is judged lost for %s s",
            restarted,
            lost_after,
        )
    changed, held = 0, {}
    for worker in workers:
        silent_for = worker_silence_seconds(worker, latest.get(worker.pk), now, watched_since=watch.since)
        if worker.state == State.LOST:
            if silent_for > settings.FLEET_WORKER_OFFLINE_AFTER_SECONDS:
                worker_set_state(worker=worker, to_state=State.OFFLINE, now=now)
                changed += 1
        elif silent_for > lost_after:
            endpoints = worker_replica_endpoints(worker_id=worker.pk)
            if endpoints and any_replica_answers(endpoint_urls=endpoints, token=settings.FLEET_WORKER_TOKEN):
                held[worker.pk] = watch.held.get(worker.pk, at)
                if worker.pk not in watch.held:
                    logger.warning(
                        "worker %s silent for %.1f s, but its replicas answer: not marked lost "
                        "(the control plane is not recording its heartbeats); judgement paused for it",
                        worker.name,
                        silent_for,
                    )
                continue
            changed += _worker_mark_lost(worker_id=worker.pk, now=now, watched_since=watch.since)
        elif worker.pk in watch.held:
            logger.warning(
                "worker %s heard from again after %.1f s held: its replicas were kept",
                worker.name,
                at - watch.held[worker.pk],
            )
    heartbeat_cache.store_lost_watch(watch=replace(watch, checked_at=at, held=held).to_json())
    return changed


@transaction.atomic
def _worker_mark_lost(*, worker_id: int, now: datetime, watched_since: float) -> bool:
    worker = Worker.objects.select_for_update(no_key=True).get(pk=worker_id)
    silent_for = worker_silence_seconds(
        worker, heartbeat_cache.read(worker_id=worker_id), now, watched_since=watched_since
    )
    if (
        worker.state not in (Worker.State.ONLINE, Worker.State.DRAINING)
        or silent_for <= settings.FLEET_WORKER_LOST_AFTER_SECONDS
    ):
        return False  # a heartbeat or another checker got there first
    replicas = list(
        Replica.objects.select_for_update(no_key=True)
        .select_related("deployment__model")
        .filter(worker=worker, state__in=Replica.LIVE_STATES)
        .order_by("pk")
    )
    gone_on_purpose = worker.state == Worker.State.DRAINING and not replicas
    worker.state = Worker.State.OFFLINE if gone_on_purpose else Worker.State.LOST
    worker.state_changed_at = now
    worker.save(update_fields=["state", "state_changed_at"])
    publish_worker(worker)
    for replica in replicas:
        replica_transition_locked(
            replica,
            to_state=Replica.State.FAILED,
            at=now,
            failure=Replica.Failure.WORKER_LOST,
            error=f"Worker {worker.name} lost: no heartbeat for {silent_for:.1f} s, and its replicas do not answer.",
        )
    if replicas:
        commands.request_reconcile(deployment_ids=[r.deployment_id for r in replicas])
    return True
