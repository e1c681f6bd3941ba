"""Writes for the fleet: worker registration, heartbeats and lost workers, replica placement and
state changes, deployments (desired replicas: create, scale, edit, wake for a waiting request), the
operators' load/unload/drain, and the autoscaler's decisions. Atomic; messages go out after commit."""

import logging
from dataclasses import replace
from datetime import datetime

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.forms.models import model_to_dict
from django.utils import timezone

from controlplane import live_events
from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, changes
from controlplane.catalog.models import AUTOSCALING_BOUNDS, Deployment
from controlplane.catalog.selectors import model_get_by_public_name
from controlplane.common.services import validated_save
from controlplane.fleet import commands, heartbeat_cache
from controlplane.fleet.autoscaling import AutoscalePolicy, Decision, DeploymentSignals, decide, popular
from controlplane.fleet.backoff import next_attempt_at
from controlplane.fleet.lost_watch import Watch, watch_resume
from controlplane.fleet.staging import StagingCandidate, StagingWorker, plan_staging
from controlplane.fleet.heartbeat import FAILED, STOPPED, HeartbeatPlan, RecordedReplica, plan_heartbeat
from controlplane.fleet.models import AutoscaleDecision, Gpu, LoadBackoff, Replica, Worker
from controlplane.fleet.placement import (
    SlotRoom,
    group_fits,
    memory_fraction,
    room_message,
    share_bytes,
    slot_groups,
)
from controlplane.fleet.replica_probe import any_replica_answers
from controlplane.fleet.selectors import (
    deployment_replica_loads,
    placement_slots,
    worker_replica_endpoints,
    worker_silence_seconds,
)
from controlplane.fleet.cold_start_counts import cold_start_waiting
from controlplane.fleet.traffic import TrafficSnapshot, traffic_snapshot
from gpuworker.contract.heartbeat import Heartbeat, WorkerRegistration
from gpuworker.contract.tasks import DrainWorker, LoadModel, StageWeights, UnloadModel

logger = logging.getLogger(__name__)


class WorkerUnknown(Exception):
    """A heartbeat named a worker id the control plane does not have; the daemon registers again."""


def _publish_worker(worker: Worker) -> None:
    live_events.publish(group=live_events.FLEET_GROUP, event="worker.state", data={
        "worker_id": worker.pk, "name": worker.name, "state": worker.state,
    })


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
    worker.state = Worker.State.ONLINE
    worker.state_changed_at = now
    validated_save(worker)
    known = {gpu.index: gpu for gpu in Gpu.objects.select_for_update().filter(worker=worker)}
    for spec in registration.gpus:
        gpu = known.pop(spec.index, None) or Gpu(worker=worker, index=spec.index)
        gpu.name, gpu.memory_total_bytes, gpu.present = spec.name, spec.memory_total_bytes, True
        validated_save(gpu)
    Gpu.objects.filter(pk__in=[gpu.pk for gpu in known.values()]).update(present=False)
    state = {"worker_id": worker.pk, "name": worker.name, "state": worker.state, "received_at": now.timestamp()}
    transaction.on_commit(lambda: heartbeat_cache.store(worker_id=worker.pk, state=state))
    _publish_worker(worker)
    # New capacity: deployments waiting for room may fit now.
    commands.request_reconcile()
    return worker


def _worker_set_state(*, worker: Worker, to_state: str, now: datetime) -> Worker:
    # Conditional on the state we read, so a concurrent change (lost marking, drain) wins cleanly.
    if Worker.objects.filter(pk=worker.pk, state=worker.state).update(state=to_state, state_changed_at=now):
        worker.state, worker.state_changed_at = to_state, now
        _publish_worker(worker)
    return worker


def worker_heartbeat(*, worker_id: int, heartbeat: Heartbeat, now: datetime) -> list[int]:
    """Record one heartbeat: live figures to the cache, state changes to the database. Returns the
    replica ids the worker should unload (ones it runs that the control plane wants gone)."""
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise WorkerUnknown(f"No worker with id {worker_id}; register again.")
    State = Worker.State
    if worker.state in (State.LOST, State.OFFLINE) or (worker.state == State.ONLINE and heartbeat.draining):
        _worker_set_state(worker=worker, to_state=State.DRAINING if heartbeat.draining else State.ONLINE, now=now)
    if heartbeat.models is not None:
        Worker.objects.filter(pk=worker_id).update(
            model_roots=list(heartbeat.models.roots), model_paths=list(heartbeat.models.paths),
            model_quantization=dict(heartbeat.models.quantization))
    plan = plan_heartbeat(recorded=_recorded_replicas(worker_id, heartbeat), reported=list(heartbeat.replicas))
    if plan.steps:
        plan = _apply_heartbeat(worker_id=worker_id, heartbeat=heartbeat, now=now)
    state = {
        "worker_id": worker.pk, "name": worker.name, "state": worker.state, "received_at": now.timestamp(),
        "sent_at": heartbeat.sent_at, "draining": heartbeat.draining,
        "gpus": list(heartbeat.gpus), "cpu": heartbeat.cpu,
        "replicas": {str(r.replica_id): {"state": r.state, "endpoint_url": r.endpoint_url, "error": r.error,
                                         "pid": r.pid, **r.figures}
                     for r in heartbeat.replicas},
        # What the worker keeps warm for fast loads (controlplane/fleet/staging.py decides it).
        "staging": heartbeat.staging.to_json() if heartbeat.staging is not None else None,
    }
    heartbeat_cache.store(worker_id=worker.pk, state=state)
    heartbeat_cache.store_figures(worker_id=worker.pk, figures={
        "received_at": state["received_at"], "gpus": state["gpus"], "cpu": state["cpu"]})
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
    plan = plan_heartbeat(recorded=_recorded_replicas(worker_id, heartbeat, lock=True), reported=list(heartbeat.replicas))
    replicas = Replica.objects.select_related("worker", "deployment__model").in_bulk([s.replica_id for s in plan.steps])
    ended = set()
    for step in plan.steps:
        replica = replicas[step.replica_id]
        for to_state in step.path:
            _transition(replica, to_state=to_state, at=now, endpoint_url=step.endpoint_url,
                        error=step.error, failure=step.failure)
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
        logger.warning("lost-worker judgement paused: %s; silence counts from now, so no worker is judged lost "
                       "for %s s", restarted, lost_after)
    changed, held = 0, {}
    for worker in workers:
        silent_for = worker_silence_seconds(worker, latest.get(worker.pk), now, watched_since=watch.since)
        if worker.state == State.LOST:
            if silent_for > settings.FLEET_WORKER_OFFLINE_AFTER_SECONDS:
                _worker_set_state(worker=worker, to_state=State.OFFLINE, now=now)
                changed += 1
        elif silent_for > lost_after:
            endpoints = worker_replica_endpoints(worker_id=worker.pk)
            if endpoints and any_replica_answers(endpoint_urls=endpoints, token=settings.FLEET_WORKER_TOKEN):
                held[worker.pk] = watch.held.get(worker.pk, at)
                if worker.pk not in watch.held:
                    logger.warning("worker %s silent for %.1f s, but its replicas answer: not marked lost "
                                   "(the control plane is not recording its heartbeats); judgement paused for it",
                                   worker.name, silent_for)
                continue
            changed += _worker_mark_lost(worker_id=worker.pk, now=now, watched_since=watch.since)
        elif worker.pk in watch.held:
            logger.warning("worker %s heard from again after %.1f s held: its replicas were kept",
                           worker.name, at - watch.held[worker.pk])
    heartbeat_cache.store_lost_watch(watch=replace(watch, checked_at=at, held=held).to_json())
    return changed


@transaction.atomic
def _worker_mark_lost(*, worker_id: int, now: datetime, watched_since: float) -> bool:
    worker = Worker.objects.select_for_update(no_key=True).get(pk=worker_id)
    silent_for = worker_silence_seconds(worker, heartbeat_cache.read(worker_id=worker_id), now,
                                        watched_since=watched_since)
    if worker.state not in (Worker.State.ONLINE, Worker.State.DRAINING) or silent_for <= settings.FLEET_WORKER_LOST_AFTER_SECONDS:
        return False  # a heartbeat or another checker got there first
    replicas = list(Replica.objects.select_for_update(no_key=True).select_related("deployment__model")
                    .filter(worker=worker, state__in=Replica.LIVE_STATES).order_by("pk"))
    gone_on_purpose = worker.state == Worker.State.DRAINING and not replicas
    worker.state = Worker.State.OFFLINE if gone_on_purpose else Worker.State.LOST
    worker.state_changed_at = now
    worker.save(update_fields=["state", "state_changed_at"])
    _publish_worker(worker)
    for replica in replicas:
        _transition(replica, to_state=Replica.State.FAILED, at=now, failure=Replica.Failure.WORKER_LOST,
                    error=f"Worker {worker.name} lost: no heartbeat for {silent_for:.1f} s, and its replicas "
                          f"do not answer.")
    if replicas:
        commands.request_reconcile(deployment_ids=[r.deployment_id for r in replicas])
    return True


def _transition(replica: Replica, *, to_state: str, at: datetime, endpoint_url: str | None = None,
                error: str = "", failure: str = "") -> Replica:
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
    _publish_replica(replica)
    return replica


def _load_backoff_record(replica: Replica, *, at: datetime) -> LoadBackoff:
    """One more failed load of the replica's deployment on its worker: leave that worker out until
    the next attempt's time (FLEET_LOAD_RETRY_*), keeping the error."""
    backoff, _ = LoadBackoff.objects.get_or_create(
        deployment_id=replica.deployment_id, worker_id=replica.worker_id,
        defaults={"first_failed_at": at, "last_failed_at": at, "next_attempt_at": at})
    backoff = LoadBackoff.objects.select_for_update().select_related("deployment__model").get(pk=backoff.pk)
    if backoff.consecutive_failures and backoff.last_failed_at < backoff.deployment.model.updated_at:
        # Failures of the model as it was before its last edit do not count against it now.
        backoff.consecutive_failures, backoff.first_failed_at = 0, at
    backoff.consecutive_failures += 1
    backoff.last_failed_at, backoff.last_error = at, replica.last_error
    backoff.next_attempt_at = next_attempt_at(
        failed_at=at, consecutive_failures=backoff.consecutive_failures,
        initial_seconds=settings.FLEET_LOAD_RETRY_INITIAL_SECONDS, max_seconds=settings.FLEET_LOAD_RETRY_MAX_SECONDS)
    backoff.save()
    return backoff


def _publish_replica(replica: Replica) -> None:
    live_events.publish(group=live_events.FLEET_GROUP, event="replica.state", data={
        "replica_id": replica.pk, "deployment_id": replica.deployment_id, "worker_id": replica.worker_id,
        "state": replica.state, "endpoint_url": replica.endpoint_url, "error": replica.last_error,
    })


@transaction.atomic
def replica_transition(
    *, replica: Replica, to_state: str, at: datetime, endpoint_url: str | None = None, error: str = "",
    failure: str = "",
) -> Replica:
    """Move a replica along its state machine; an illegal move raises ValidationError and writes nothing."""
    # Lock the row: a heartbeat and a reconcile task may move the same replica concurrently.
    replica = Replica.objects.select_for_update(no_key=True).get(pk=replica.pk)
    return _transition(replica, to_state=to_state, at=at, endpoint_url=endpoint_url, error=error, failure=failure)


@transaction.atomic
def replica_place(*, deployment, worker: Worker, gpu: Gpu | None) -> Replica:
    """Create a pending replica and send the worker its load message (after commit). `gpu`: the
    first of its GPUs when the model is split over several (tensor_parallel_size)."""
    model = deployment.model
    size = model.tensor_parallel_size
    replica = validated_save(Replica(deployment=deployment, worker=worker, gpu=gpu, state=Replica.State.PENDING,
                                     tensor_parallel_size=size))
    _publish_replica(replica)  # the fleet page shows the new replica at once, before it loads
    need = share_bytes(need_bytes=model.gpu_memory_bytes, on_gpu=gpu is not None, tensor_parallel_size=size)
    total = gpu.memory_total_bytes if gpu is not None else worker.cpu_memory_total_bytes
    commands.send_to_worker(queue=worker.queue_name, task=LoadModel(
        replica_id=replica.pk, model_path=model.weights_path, served_model_name=model.public_name,
        gpu_index=gpu.index if gpu is not None else None,
        memory_fraction=memory_fraction(need_bytes=need, total_bytes=total),
        max_model_len=model.context_length, tensor_parallel_size=size,
    ))
    return replica


def replica_stop(*, replica: Replica, at: datetime) -> Replica:
    """Take a locked, active replica out of service: a pending one stops at once, others drain.
    The unload message goes either way, in case the load message is still on its way."""
    to_state = Replica.State.STOPPED if replica.state == Replica.State.PENDING else Replica.State.DRAINING
    _transition(replica, to_state=to_state, at=at)
    commands.send_to_worker(queue=replica.worker.queue_name, task=UnloadModel(
        replica_id=replica.pk, drain_timeout_s=float(settings.FLEET_UNLOAD_DRAIN_TIMEOUT_SECONDS)))
    return replica


# --- Deployments (how many replicas of each model are wanted; reconcile places or drains the rest)
# and the operators' actions. `actor` is the user acting (None: the system); each lands in the audit log.


def publish_deployment(deployment: Deployment, *, created: bool = False) -> None:
    """Tell the fleet pages a deployment changed (its desired count or limits, its backoffs, why it
    is unplaced): they show its status again; a new one joins the list."""
    live_events.publish(group=live_events.FLEET_GROUP, event="deployment.changed", data={
        "deployment_id": deployment.pk, "created": created,
    })


# What a deployment edit may change, and what its audit entry compares.
DEPLOYMENT_FIELDS = ("desired_replicas", "min_replicas", "max_replicas", "keep_warm")
# More replicas of one model than any one fleet here runs; a typo (100 for 10) is refused.
MAX_REPLICAS_LIMIT = 256


def _lock_deployment(deployment: Deployment) -> Deployment:
    return Deployment.objects.select_for_update().select_related("model").get(pk=deployment.pk)


def _check_whole_number(value, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError({field: f"Must be a whole number, not {value!r}."})


def _check_replica_count(value, field: str) -> None:
    _check_whole_number(value, field)
    if not 0 <= value <= MAX_REPLICAS_LIMIT:
        raise ValidationError({field: f"Must lie between 0 and {MAX_REPLICAS_LIMIT}; got {value}."})


@transaction.atomic
def deployment_create(
    *,
    model_name: str,
    desired_replicas: int = 1,
    min_replicas: int = 0,
    max_replicas: int = 1,
    keep_warm: bool = False,
    autoscale: bool = True,
    actor=None,
) -> Deployment:
    model = model_get_by_public_name(public_name=model_name)
    if model is None:
        raise ValidationError({"model": f"Unknown model {model_name!r}."})
    deployment = validated_save(Deployment(model=model, desired_replicas=desired_replicas, min_replicas=min_replicas,
                                           max_replicas=max_replicas, keep_warm=keep_warm, autoscale=autoscale,
                                           scaled_at=timezone.now()))
    audit_record(actor=actor, action=AuditEntry.Action.DEPLOYMENT_CREATE, target=deployment,
                 target_label=model.public_name, detail=model_to_dict(deployment, fields=DEPLOYMENT_FIELDS))
    publish_deployment(deployment, created=True)
    commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment


@transaction.atomic
def deployment_scale(*, deployment: Deployment, desired_replicas: int, actor=None) -> Deployment:
    """Want `desired_replicas` replicas; reconcile places or drains the difference."""
    # Lock the row so two operators scaling at once cannot both pass validation on stale bounds.
    deployment = Deployment.objects.select_for_update().select_related("model").get(pk=deployment.pk)
    return _deployment_set_desired(deployment=deployment, desired_replicas=desired_replicas, actor=actor,
                                   now=timezone.now())


def _deployment_set_desired(*, deployment: Deployment, desired_replicas: int, actor, now: datetime,
                            detail: dict | None = None) -> Deployment:
    """The one path that changes a locked deployment's desired replicas on its own (an operator's
    scale, the autoscaler's decision): bounds, the scaling time cooldowns count from, audit, reconcile."""
    _check_whole_number(desired_replicas, "desired_replicas")
    if not deployment.min_replicas <= desired_replicas <= deployment.max_replicas:
        # In the words of the limits form (Min, Max), naming the one to change.
        fix = ("raise Max replicas" if desired_replicas > deployment.max_replicas else "lower Min replicas")
        raise ValidationError({"desired_replicas": (
            f"This deployment allows {deployment.min_replicas} to {deployment.max_replicas} replicas; "
            f"{fix} to scale to {desired_replicas}."
        )})
    before = deployment.desired_replicas
    deployment.desired_replicas = desired_replicas
    deployment.scaled_at = now
    deployment.full_clean()
    deployment.save(update_fields=["desired_replicas", "scaled_at", "updated_at"])
    audit_record(actor=actor, action=AuditEntry.Action.DEPLOYMENT_SCALE, target=deployment,
                 target_label=deployment.model.public_name,
                 detail={"desired_replicas": [before, desired_replicas], **(detail or {})})
    publish_deployment(deployment)
    commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment


def deployment_wake(*, model_id: int) -> bool:
    """Want at least one replica of this model, because a request is waiting for it (a cold start
    from zero). True when the deployment wants one now (it already did, or does from now on);
    False when it may not have any (no deployment, or max_replicas 0). Cheap when already awake:
    one read, no lock, no write; the gateway calls it at most every few seconds per model."""
    wants = Deployment.objects.filter(model_id=model_id).values_list("desired_replicas", "max_replicas").first()
    if wants is None or wants[1] < 1:
        return False
    if wants[0] >= 1:
        return True
    return _deployment_wake_locked(model_id=model_id)


@transaction.atomic
def _deployment_wake_locked(*, model_id: int) -> bool:
    deployment = Deployment.objects.select_for_update().select_related("model").filter(model_id=model_id).first()
    if deployment is None or deployment.max_replicas < 1:
        return False  # changed since the read above
    if deployment.desired_replicas >= 1:
        return True  # another gateway process woke it first
    _deployment_set_desired(deployment=deployment, desired_replicas=1, actor=None, now=timezone.now(),
                            detail={"reason": "cold start: a request is waiting for a replica"})
    return True


@transaction.atomic
def deployment_update(
    *, deployment: Deployment, desired_replicas: int, min_replicas: int, max_replicas: int, keep_warm: bool,
    autoscale: bool | None = None, target_concurrency: int | None = None, ttft_slo_ms: int | None = None,
    itl_slo_ms: int | None = None, idle_to_zero_seconds: int | None = None, actor=None,
) -> Deployment:
    """Set a deployment's replica counts, keep-warm and (each unless None) autoscaling settings at
    once; each bad value is reported on its own field, and min <= desired <= max must hold afterwards."""
    deployment = _lock_deployment(deployment)
    values = {"desired_replicas": desired_replicas, "min_replicas": min_replicas, "max_replicas": max_replicas}
    errors: dict[str, list[str]] = {}
    for field, value in values.items():
        try:
            _check_replica_count(value, field)
        except ValidationError as exc:
            errors.update(exc.message_dict)
    flags = {"keep_warm": keep_warm, **({"autoscale": autoscale} if autoscale is not None else {})}
    for field, value in flags.items():
        if not isinstance(value, bool):
            errors[field] = [f"Must be true or false, not {value!r}."]
    autoscaling = {field: value for field, value in {
        "target_concurrency": target_concurrency, "ttft_slo_ms": ttft_slo_ms, "itl_slo_ms": itl_slo_ms,
        "idle_to_zero_seconds": idle_to_zero_seconds,
    }.items() if value is not None}
    for field, value in autoscaling.items():
        low, high = AUTOSCALING_BOUNDS[field]
        if isinstance(value, bool) or not isinstance(value, int):
            errors[field] = [f"Must be a whole number, not {value!r}."]
        elif not low <= value <= high:
            errors[field] = [f"Must lie between {low:,} and {high:,}; got {value:,}."]
    if not errors:
        if min_replicas > max_replicas:
            errors["min_replicas"] = [f"Min replicas ({min_replicas}) cannot exceed max replicas ({max_replicas})."]
        elif not min_replicas <= desired_replicas <= max_replicas:
            errors["desired_replicas"] = [f"Desired replicas must lie between min ({min_replicas}) and max "
                                          f"({max_replicas}); got {desired_replicas}."]
    if errors:
        raise ValidationError(errors)
    compared = (*DEPLOYMENT_FIELDS, "autoscale", *AUTOSCALING_BOUNDS)
    before = model_to_dict(deployment, fields=compared)
    for field, value in {**values, **flags, **autoscaling}.items():
        setattr(deployment, field, value)
    deployment.full_clean()
    diff = changes(before, model_to_dict(deployment, fields=compared))
    if not diff:
        return deployment
    if "desired_replicas" in diff:
        deployment.scaled_at = timezone.now()  # an operator's scale: the autoscaler's cooldowns restart
    deployment.save()
    audit_record(actor=actor, action=AuditEntry.Action.DEPLOYMENT_UPDATE, target=deployment,
                 target_label=deployment.model.public_name, detail=diff)
    publish_deployment(deployment)
    if "desired_replicas" in diff:
        commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment


@transaction.atomic
def replica_load_on(*, deployment, worker: Worker, gpu: Gpu | None, actor=None) -> Replica:
    """Put one more replica of `deployment` on this worker's GPU (None on a CPU-only worker; the
    first of its GPUs for a model split over several).
    Allowed where the model failed before: unlike reconcile's retries, this is a person's choice."""
    deployment = _lock_deployment(deployment)
    worker = Worker.objects.select_for_update(no_key=True).get(pk=worker.pk)
    model = deployment.model
    if worker.state != Worker.State.ONLINE:
        raise ValidationError({"worker": f"Worker {worker.name} is {worker.state}; only an online worker takes new replicas."})
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
        raise ValidationError({"gpu": f"{model.public_name} is split over {size} GPUs: from GPU {first} it needs "
                                      f"GPUs {first}–{last} of {worker.name}, and not all of them are present."})
    if not group_fits(group, need_bytes=model.gpu_memory_bytes, tensor_parallel_size=size):
        gpus = Gpu.objects.in_bulk([slot.gpu_id for slot in group if slot.gpu_id is not None])
        rooms = [SlotRoom(label=slot_label(worker=worker, gpu=gpus.get(slot.gpu_id)),
                          free_bytes=slot.free_bytes, total_bytes=slot.total_bytes) for slot in group]
        raise ValidationError({"gpu": f"{model.public_name} does not fit: "
                                      f"{room_message(need_bytes=model.gpu_memory_bytes, rooms=rooms, tensor_parallel_size=size)}."})
    if deployment.desired_replicas >= deployment.max_replicas:
        raise ValidationError({"deployment": f"{model.public_name} already wants {deployment.desired_replicas} "
                                             f"replicas, its max_replicas ({deployment.max_replicas}); raise it first."})
    # One more wanted, so reconcile keeps this replica instead of draining it as surplus.
    deployment.desired_replicas += 1
    deployment.scaled_at = timezone.now()
    deployment.save(update_fields=["desired_replicas", "scaled_at", "updated_at"])
    replica = replica_place(deployment=deployment, worker=worker, gpu=gpu)
    publish_deployment(deployment)
    audit_record(actor=actor, action=AuditEntry.Action.REPLICA_LOAD, target=replica,
                 target_label=f"{model.public_name} replica {replica.pk} on {worker.name}", detail={
        "model": model.public_name, "worker": worker.name, "gpu_index": gpu.index if gpu is not None else None,
        "desired_replicas": [deployment.desired_replicas - 1, deployment.desired_replicas],
    })
    return replica


def slot_label(*, worker: Worker, gpu: Gpu | None) -> str:
    """Where a replica runs, as messages name it: "worker-a GPU 0 (NVIDIA H200)" or "worker-a CPU"."""
    return f"{worker.name} GPU {gpu.index} ({gpu.name})" if gpu is not None else f"{worker.name} CPU"


@transaction.atomic
def deployment_retry_loads(*, deployment: Deployment, actor=None) -> Deployment:
    """Forget the deployment's load backoffs and reconcile now: every worker may be tried at once
    (after the operator fixed whatever made the loads fail)."""
    deployment = _lock_deployment(deployment)
    backoffs = list(LoadBackoff.objects.select_for_update().select_related("worker").filter(deployment=deployment)
                    .order_by("pk"))
    if not backoffs:
        raise ValidationError({"deployment": f"{deployment.model.public_name} has no failed loads to retry."})
    LoadBackoff.objects.filter(pk__in=[b.pk for b in backoffs]).delete()
    audit_record(actor=actor, action=AuditEntry.Action.DEPLOYMENT_RETRY, target=deployment,
                 target_label=deployment.model.public_name, detail={
        "backoffs": {b.worker.name: b.consecutive_failures for b in backoffs},
    })
    publish_deployment(deployment)
    commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment


@transaction.atomic
def replica_unload(*, replica: Replica, actor=None) -> Replica:
    """Drain and stop this replica, and want one replica fewer so reconcile does not replace it."""
    deployment = _lock_deployment(replica.deployment)
    replica = Replica.objects.select_for_update(no_key=True).select_related("worker").get(pk=replica.pk)
    if replica.state not in Replica.ACTIVE_STATES:
        raise ValidationError({"replica": f"Replica {replica.pk} is {replica.state}; only a pending, loading "
                                          f"or ready replica can be unloaded."})
    if deployment.desired_replicas - 1 < deployment.min_replicas:
        raise ValidationError({"replica": f"{deployment.model.public_name} must keep at least "
                                          f"{deployment.min_replicas} replicas (min_replicas); lower it first."})
    deployment.desired_replicas -= 1
    deployment.scaled_at = timezone.now()
    deployment.save(update_fields=["desired_replicas", "scaled_at", "updated_at"])
    was = replica.state
    replica = replica_stop(replica=replica, at=timezone.now())
    publish_deployment(deployment)
    audit_record(actor=actor, action=AuditEntry.Action.REPLICA_UNLOAD, target=replica,
                 target_label=f"{deployment.model.public_name} replica {replica.pk} on {replica.worker.name}", detail={
        "model": deployment.model.public_name, "worker": replica.worker.name, "state": [was, replica.state],
        "desired_replicas": [deployment.desired_replicas + 1, deployment.desired_replicas],
    })
    return replica


@transaction.atomic
def worker_drain(*, worker: Worker, actor=None) -> Worker:
    """Stop placing on this worker and move its replicas elsewhere; the daemon finishes in-flight
    requests (up to FLEET_WORKER_DRAIN_TIMEOUT_SECONDS) and stops them."""
    worker = Worker.objects.select_for_update(no_key=True).get(pk=worker.pk)
    if worker.state != Worker.State.ONLINE:
        raise ValidationError({"worker": f"Worker {worker.name} is {worker.state}; only an online worker can be drained."})
    now = timezone.now()
    worker.state, worker.state_changed_at = Worker.State.DRAINING, now
    worker.save(update_fields=["state", "state_changed_at"])
    _publish_worker(worker)
    replicas = list(Replica.objects.select_for_update(no_key=True).filter(worker=worker, state__in=Replica.ACTIVE_STATES).order_by("pk"))
    for replica in replicas:
        to_state = Replica.State.STOPPED if replica.state == Replica.State.PENDING else Replica.State.DRAINING
        _transition(replica, to_state=to_state, at=now)
    commands.send_to_worker(queue=worker.queue_name,
                            task=DrainWorker(timeout_s=float(settings.FLEET_WORKER_DRAIN_TIMEOUT_SECONDS)))
    audit_record(actor=actor, action=AuditEntry.Action.WORKER_DRAIN, target=worker, target_label=worker.name, detail={
        "state": [Worker.State.ONLINE, worker.state], "replicas_moved": [r.pk for r in replicas],
    })
    if replicas:
        commands.request_reconcile(deployment_ids=[r.deployment_id for r in replicas])
    return worker


# --- The autoscaler: one decision per deployment per tick (Celery beat, tasks.autoscale), made by
# the pure policy in autoscaling.py from the heartbeats' figures and the gateway's traffic counts.

def autoscale_policy(deployment: Deployment) -> AutoscalePolicy:
    """A deployment's policy: its own fields, and the fleet-wide settings."""
    return AutoscalePolicy(
        min_replicas=deployment.min_replicas, max_replicas=deployment.max_replicas, keep_warm=deployment.keep_warm,
        target_concurrency=float(deployment.target_concurrency),
        target_utilisation=settings.AUTOSCALE_TARGET_UTILISATION_PERCENT / 100,
        hysteresis=settings.AUTOSCALE_HYSTERESIS_PERCENT / 100,
        ttft_slo_s=deployment.ttft_slo_ms / 1000, itl_slo_s=deployment.itl_slo_ms / 1000,
        kv_cache_high=settings.AUTOSCALE_KV_CACHE_HIGH_PERCENT / 100,
        scale_up_cooldown_s=float(settings.AUTOSCALE_SCALE_UP_COOLDOWN_SECONDS),
        scale_down_cooldown_s=float(settings.AUTOSCALE_SCALE_DOWN_COOLDOWN_SECONDS),
        idle_to_zero_s=float(deployment.idle_to_zero_seconds),
    )


def deployments_autoscale(*, now: datetime) -> list[AutoscaleDecision]:
    """Decide once for every deployment with autoscaling on. Without the gateway's counts (Redis
    down) nothing is decided: no traffic seen must not read as no traffic, which scales to zero."""
    rows = list(Deployment.objects.filter(autoscale=True, model__enabled=True).order_by("pk")
                .values_list("pk", "model_id"))
    try:
        traffic = traffic_snapshot(now=now.timestamp(), rate_window_s=settings.AUTOSCALE_RATE_WINDOW_SECONDS,
                                   popular_window_s=settings.AUTOSCALE_POPULAR_WINDOW_SECONDS)
        queued = cold_start_waiting(model_ids=[model_id for _, model_id in rows])
    except Exception:
        logger.warning("autoscaler: the gateway's traffic counts are unreadable; no decisions this tick",
                       exc_info=True)
        return []
    popular_models = popular(traffic.window_counts, settings.AUTOSCALE_POPULAR_TOP_K)
    decisions = [deployment_autoscale(deployment_id=pk, now=now, traffic=traffic, popular_models=popular_models,
                                      queued_cold_starts=queued.get(model_id, 0))
                 for pk, model_id in rows]
    return [d for d in decisions if d is not None]


@transaction.atomic
def deployment_autoscale(*, deployment_id: int, now: datetime, traffic: TrafficSnapshot,
                         popular_models: set[int], queued_cold_starts: int = 0) -> AutoscaleDecision | None:
    """One decision for one deployment, under its row lock (an operator's scale waits, then counts
    for the cooldown). A change goes through the same path as an operator's scale, audited as the
    system's with the decision's reason and inputs; every decision is stored and published."""
    deployment = Deployment.objects.select_for_update().select_related("model").filter(pk=deployment_id).first()
    if deployment is None or not deployment.autoscale:
        return None
    model_id = deployment.model_id
    current, loads = deployment_replica_loads(deployment=deployment)
    signals = DeploymentSignals(
        now=now.timestamp(), current_replicas=current, loads=tuple(loads),
        request_rate_per_s=traffic.rate_per_s.get(model_id, 0.0),
        last_request_at=traffic.last_request_at.get(model_id),
        last_scaled_at=deployment.scaled_at.timestamp() if deployment.scaled_at else None,
        popular=model_id in popular_models, queued_cold_starts=queued_cold_starts,
    )
    decision = decide(autoscale_policy(deployment), signals)
    applied = _autoscale_apply(deployment=deployment, decision=decision, now=now)
    stored, _ = AutoscaleDecision.objects.update_or_create(deployment=deployment, defaults={
        "action": applied, "desired_replicas": deployment.desired_replicas, "reason": decision.reason[:500],
        "inputs": decision.inputs, "decided_at": now,
    })
    live_events.publish(group=live_events.FLEET_GROUP, event="autoscale.decision", data={
        "deployment_id": deployment.pk, "action": applied, "desired_replicas": deployment.desired_replicas,
        "reason": stored.reason, "inputs": decision.inputs, "decided_at": now.timestamp(),
    })
    return stored


def _autoscale_apply(*, deployment: Deployment, decision: Decision, now: datetime) -> str:
    """Move desired replicas only the way the decision points: the policy counts active replicas,
    which lag desired ones (still placing, or no room), and must not undo a wish it agrees with."""
    before = deployment.desired_replicas
    if decision.action == "up" and decision.desired > before or decision.action == "down" and decision.desired < before:
        _deployment_set_desired(deployment=deployment, desired_replicas=decision.desired, actor=None, now=now,
                                detail={"autoscaler": decision.reason, "inputs": decision.inputs})
        return decision.action
    return AutoscaleDecision.Action.HOLD.value
def workers_stage_weights() -> dict[int, tuple[str, ...]]:
    """Send each online worker the checkpoints it should keep warm (plan_staging), only when its
    list changed since the last one sent. Returns the lists sent, by worker id."""
    workers = list(Worker.objects.filter(state=Worker.State.ONLINE))
    latest = heartbeat_cache.read_many(worker_ids=[w.pk for w in workers])
    running: dict[int, set[str]] = {}
    for worker_id, path in Replica.objects.filter(worker__in=workers, state__in=Replica.LIVE_STATES).values_list(
            "worker_id", "deployment__model__weights_path"):
        running.setdefault(worker_id, set()).add(path)
    staging_workers = [
        StagingWorker(worker_id=w.pk, budget_bytes=int(((latest.get(w.pk) or {}).get("staging") or {}).get("budget_bytes", 0)),
                      model_paths=frozenset(w.model_paths or ()), running_paths=frozenset(running.get(w.pk, ())))
        for w in workers]
    try:  # busiest first: requests over the popularity window, as the gateways counted them
        traffic = traffic_snapshot(now=timezone.now().timestamp(), rate_window_s=settings.AUTOSCALE_RATE_WINDOW_SECONDS,
                                   popular_window_s=settings.AUTOSCALE_POPULAR_WINDOW_SECONDS).window_counts
    except Exception:
        logger.warning("staging: the gateway's traffic counts are unreadable; nothing sent this time", exc_info=True)
        return {}
    candidates = [
        StagingCandidate(model_path=d.model.weights_path, weight_bytes=d.model.gpu_memory_bytes,
                         traffic=float(traffic.get(d.model_id, 0.0)), headroom=d.desired_replicas < d.max_replicas)
        for d in Deployment.objects.select_related("model").filter(model__enabled=True)]
    sent = {}
    queues = {w.pk: w.queue_name for w in workers}
    for worker_id, paths in plan_staging(staging_workers, candidates).items():
        if heartbeat_cache.staging_sent(worker_id=worker_id) == list(paths):
            continue
        commands.send_to_worker(queue=queues[worker_id], task=StageWeights(model_paths=paths))
        heartbeat_cache.store_staging_sent(worker_id=worker_id, model_paths=list(paths))
        sent[worker_id] = paths
    return sent
