"""Reads for the fleet: ready replicas, free capacity for placement, each worker's latest heartbeat,
and each deployment's status and last error for the operators' pages."""

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Count, F, FloatField, Prefetch, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.billing.models import UsageRecord
from controlplane.catalog.models import Deployment, Model
from controlplane.catalog.selectors import perplexity_increase, quality_refusal
from controlplane.fleet import heartbeat_cache
from controlplane.fleet.autoscaling import ReplicaLoad
from controlplane.fleet.backoff import error_cause
from controlplane.fleet.lost_watch import Watch, paused_reasons
from controlplane.fleet.models import (
    Gpu,
    LoadBackoff,
    PlacementReport,
    QualityMeasurement,
    RebalanceMove,
    Replica,
    Worker,
)
from controlplane.fleet.placement import Candidate, Slot, held_gpu_indexes, held_places, share_bytes


def replicas_ready_for_model(*, model) -> QuerySet[Replica]:
    """Replicas that can take requests for `model` right now, on workers that are online."""
    return Replica.objects.filter(
        deployment__model=model, state=Replica.State.READY, worker__state=Worker.State.ONLINE
    ).select_related("worker", "gpu")


def first_ready_chat_model(*, models: Iterable[Model]) -> Model | None:
    """Of `models`, the first in the catalog's order (oldest first) that chats in text and has a
    ready replica on an online worker now: what a page offers before its reader picks one."""
    chat = sorted((m for m in models if m.kind == Model.Kind.CHAT), key=lambda m: m.pk)
    ready = set(
        Replica.objects.filter(
            deployment__model__in=chat, state=Replica.State.READY, worker__state=Worker.State.ONLINE
        ).values_list("deployment__model_id", flat=True)
    )
    return next((m for m in chat if m.pk in ready), None)


def worker_latest_heartbeat(*, worker_id: int) -> dict[str, Any] | None:
    """The worker's latest heartbeat as stored (figures per GPU, CPU and replica), or None."""
    return heartbeat_cache.read(worker_id=worker_id)


def workers_latest_heartbeats(*, worker_ids: Iterable[int]) -> dict[int, dict[str, Any]]:
    return heartbeat_cache.read_many(worker_ids=list(worker_ids))


def worker_silence_seconds(
    worker: Worker, latest: dict | None, now: datetime, *, watched_since: float | None = None
) -> float:
    """Seconds since the worker was last heard from (`latest`: its cached heartbeat, if any), or,
    with `watched_since` (epoch seconds: the lost-worker judge's watch, lost_watch.py), the part of
    them since then: the silence the control plane could have recorded a heartbeat in."""
    # Counted from the last state change too: a worker with no heartbeat cached yet (just
    # registered, or the cache was flushed) is not lost before its first heartbeat is due.
    last = max((latest or {}).get("received_at", 0.0), worker.state_changed_at.timestamp(), watched_since or 0.0)
    return now.timestamp() - last


def worker_replica_endpoints(*, worker_id: int) -> list[str]:
    """The endpoints of the worker's live replicas that have one (a pending replica has none yet)."""
    return list(
        Replica.objects.filter(worker_id=worker_id, state__in=Replica.LIVE_STATES)
        .exclude(endpoint_url="")
        .order_by("pk")
        .values_list("endpoint_url", flat=True)
    )


@dataclass(frozen=True)
class LostJudgement:
    """Whether the lost-worker judge can judge now, for /metrics."""

    paused_reasons: list[str]  # lost_watch.PAUSE_REASONS that hold now; empty: judging every worker
    checked_at: float | None  # when its latest completed check began (epoch seconds); None: none recorded


def lost_judgement(*, now: datetime) -> LostJudgement:
    watch = Watch.from_json(heartbeat_cache.lost_watch())
    reasons = paused_reasons(watch, now=now.timestamp(), lost_after_s=settings.FLEET_WORKER_LOST_AFTER_SECONDS)
    return LostJudgement(paused_reasons=reasons, checked_at=watch.checked_at if watch is not None else None)


def workers_heard_from(*, now: datetime) -> list[tuple[Worker, float]]:
    """Workers not offline, each with the seconds since it was last heard from."""
    workers = list(Worker.objects.exclude(state=Worker.State.OFFLINE))
    latest = workers_latest_heartbeats(worker_ids=[worker.pk for worker in workers])
    return [(worker, worker_silence_seconds(worker, latest.get(worker.pk), now)) for worker in workers]


def replica_counts_by_model_and_state() -> dict[tuple[str, str], int]:
    """Live replicas (pending, loading, ready, draining) per deployed model and state; every pair
    of a deployed model and a live state is there, 0 where none is."""
    counts = {
        (name, state): 0
        for name in Deployment.objects.values_list("model__public_name", flat=True)
        for state in Replica.LIVE_STATES
    }
    rows = (
        Replica.objects.filter(state__in=Replica.LIVE_STATES)
        .values_list("deployment__model__public_name", "state")
        .annotate(count=Count("pk"))
        .order_by()
    )
    for name, state, count in rows:
        counts[(name, state)] = count
    return counts


def deployments_desired_replicas() -> list[tuple[str, int]]:
    """(model name, desired replicas) of every deployment, by model name."""
    return list(Deployment.objects.values_list("model__public_name", "desired_replicas").order_by("model__public_name"))


def workers_recent_figures(*, since: float, worker_ids: Iterable[int] | None = None) -> dict[int, list[dict[str, Any]]]:
    """Each worker's (all, or these) device figures from its heartbeats received after `since`
    (epoch seconds), oldest first: {"received_at", "gpus", "cpu"} each, as reported."""
    if worker_ids is None:
        worker_ids = Worker.objects.values_list("pk", flat=True)
    recent = heartbeat_cache.recent_figures(worker_ids=list(worker_ids))
    return {worker_id: [f for f in figures if f.get("received_at", 0) > since] for worker_id, figures in recent.items()}


def placement_slots(*, workers: list[Worker]) -> list[Slot]:
    """Where replicas can go on these workers: each present GPU, or a CPU-only worker's memory,
    with the memory its live replicas are estimated to use (their models' gpu_memory_bytes; a
    replica split over N GPUs counts its share on each of them). A GPU a quality measurement holds
    is taken (Slot.taken_by) whatever its free memory."""
    ids = [worker.pk for worker in workers]
    slots = [
        Slot(
            worker_id=gpu.worker_id,
            gpu_id=gpu.pk,
            gpu_index=gpu.index,
            total_bytes=gpu.memory_total_bytes,
            used_bytes=0,
        )
        for gpu in Gpu.objects.filter(worker_id__in=ids, present=True).order_by("worker_id", "index")
    ]
    slots += [
        Slot(worker_id=worker.pk, gpu_id=None, gpu_index=None, total_bytes=worker.cpu_memory_total_bytes, used_bytes=0)
        for worker in workers
        if worker.device == Worker.Device.CPU
    ]
    by_place = {(slot.worker_id, slot.gpu_index): slot for slot in slots}
    for worker_id, first_index, size, need in live_replica_placements(worker_ids=ids):
        for index in held_places(first_index=first_index, tensor_parallel_size=size):
            slot = by_place.get((worker_id, index))
            if slot is not None:
                slot.used_bytes += share_bytes(
                    need_bytes=need, on_gpu=slot.gpu_id is not None, tensor_parallel_size=size
                )
    for worker_id, index, model_name in gpus_measuring(worker_ids=ids):
        slot = by_place.get((worker_id, index))
        if slot is not None:
            slot.taken_by = f"measuring the quality of {model_name}"
    return slots


def gpus_measuring(*, worker_ids: Iterable[int]) -> list[tuple[int, int, str]]:
    """(worker id, GPU index, model name) of each quality measurement queued or running on a GPU of
    these workers: that GPU is taken until the measurement is done or failed."""
    return list(
        QualityMeasurement.objects.filter(
            worker_id__in=list(worker_ids), state__in=QualityMeasurement.IN_PROGRESS, gpu_index__isnull=False
        ).values_list("worker_id", "gpu_index", "model__public_name")
    )


def live_replica_placements(
    *, worker_ids: Iterable[int], deployment_id: int | None = None
) -> list[tuple[int, int | None, int, int]]:
    """(worker id, first GPU index or None for the CPU, tensor_parallel_size, model's gpu_memory_bytes)
    of each live replica on these workers (of one deployment, if given)."""
    rows = Replica.objects.filter(worker_id__in=list(worker_ids), state__in=Replica.LIVE_STATES)
    if deployment_id is not None:
        rows = rows.filter(deployment_id=deployment_id)
    return list(
        rows.values_list("worker_id", "gpu__index", "tensor_parallel_size", "deployment__model__gpu_memory_bytes")
    )


def removal_candidates(*, replicas: list[Replica]) -> list[Candidate]:
    """The replicas as choose_to_remove weighs them, with their requests in flight from the latest heartbeats."""
    latest = heartbeat_cache.read_many(worker_ids=list({r.worker_id for r in replicas}))

    def outstanding(replica: Replica) -> int:
        figures = (latest.get(replica.worker_id) or {}).get("replicas", {}).get(str(replica.pk), {})
        return int(figures.get("running", 0) + figures.get("waiting", 0))

    return [
        Candidate(replica_id=r.pk, state=r.state, created_at=r.created_at, outstanding_requests=outstanding(r))
        for r in replicas
    ]


def deployment_get_for_model(*, model: Model) -> Deployment | None:
    return Deployment.objects.filter(model=model).first()


def load_backoffs(*, deployment_ids: Iterable[int]) -> QuerySet[LoadBackoff]:
    """The deployments' current load backoffs, with their workers: those since each model last
    changed (editing a model, say its weight path, gives every worker a fresh start)."""
    return (
        LoadBackoff.objects.filter(
            deployment_id__in=list(deployment_ids), last_failed_at__gte=F("deployment__model__updated_at")
        )
        .select_related("worker")
        .order_by("next_attempt_at", "pk")
    )


def format_time_of_day(at: datetime) -> str:
    """A time on the operators' pages and messages: the local time of day, to the second."""
    return timezone.localtime(at).strftime("%H:%M:%S")


def backoff_note(backoff: LoadBackoff, *, now: datetime) -> str:
    """Why reconcile leaves this worker out for now, e.g. "backing off until 12:03:10 after 2 failed loads"."""
    count = backoff.consecutive_failures
    loads = f"{count} failed load{'s' if count != 1 else ''}"
    if backoff.next_attempt_at > now:
        return f"backing off until {format_time_of_day(backoff.next_attempt_at)} after {loads}"
    return f"retrying after {loads}"


@dataclass(frozen=True)
class BackoffView:
    worker_name: str
    consecutive_failures: int
    next_attempt_at: datetime
    cause: str  # the first line of its latest error


@dataclass(frozen=True)
class DeploymentStatus:
    deployment_id: int
    model_name: str
    desired_replicas: int
    ready: int
    starting: int  # pending or loading
    draining: int
    # ready, scaling (replicas starting or being removed), stopped (none wanted, none left),
    # degraded (too few, and FLEET_LOAD_DEGRADED_AFTER_FAILURES loads in a row failed: still
    # retrying) or waiting (too few, and no worker has room or every worker is backing off).
    state: str
    # The latest failure's cause (first line, in full) with its worker; its whole text when it
    # says more than that line.
    last_error: str
    message: str
    error_detail: str = ""
    # Workers this deployment is backing off from (soonest retry first); "retry now" clears them.
    backoffs: list[BackoffView] = field(default_factory=list)


def deployment_statuses(
    *, deployment_ids: Iterable[int] | None = None, now: datetime | None = None
) -> list[DeploymentStatus]:
    S = Replica.State
    deployments = Deployment.objects.select_related("model").annotate(
        n_ready=Count("replicas", filter=Q(replicas__state=S.READY)),
        n_starting=Count("replicas", filter=Q(replicas__state__in=[S.PENDING, S.LOADING])),
        n_draining=Count("replicas", filter=Q(replicas__state=S.DRAINING)),
    )
    if deployment_ids is not None:
        deployments = deployments.filter(pk__in=list(deployment_ids))
    deployments = list(deployments)
    ids = [d.pk for d in deployments]
    backoffs: dict[int, list[LoadBackoff]] = {}
    for backoff in load_backoffs(deployment_ids=ids):
        backoffs.setdefault(backoff.deployment_id, []).append(backoff)
    reports = {r.deployment_id: r for r in PlacementReport.objects.filter(deployment_id__in=ids, unplaced__gt=0)}
    moves = {
        m.deployment_id: m
        for m in RebalanceMove.objects.filter(deployment_id__in=ids, state=RebalanceMove.State.MOVING).select_related(
            "from_worker", "to_worker"
        )
    }
    now = now or timezone.now()
    return [_status(d, backoffs.get(d.pk, []), reports.get(d.pk), moves.get(d.pk), now) for d in deployments]


def _status(
    deployment,
    backoffs: list[LoadBackoff],
    report: PlacementReport | None,
    move: RebalanceMove | None,
    now: datetime,
) -> DeploymentStatus:
    ready, starting, draining = deployment.n_ready, deployment.n_starting, deployment.n_draining
    desired, model = deployment.desired_replicas, deployment.model
    failure = (
        Replica.objects.filter(
            deployment=deployment, state=Replica.State.FAILED, state_changed_at__gte=model.updated_at
        )
        .order_by("-state_changed_at", "-pk")
        .select_related("worker")
        .first()
    )
    last_error = f"{failure.worker.name}: {error_cause(failure.last_error)}" if failure else ""
    failed_in_a_row = sum(b.consecutive_failures for b in backoffs)
    active = ready + starting
    if desired == 0 and active + draining == 0:
        state, message = "stopped", "No replicas wanted."
    elif ready == desired == active and not draining:
        state, message = "ready", f"{ready} of {desired} replicas ready."
    elif ready < desired and backoffs and failed_in_a_row >= settings.FLEET_LOAD_DEGRADED_AFTER_FAILURES:
        upcoming = min(backoffs, key=lambda b: b.next_attempt_at)
        when = (
            "now"
            if upcoming.next_attempt_at <= now
            else f"at {format_time_of_day(upcoming.next_attempt_at)} on {upcoming.worker.name}"
        )
        state, message = (
            "degraded",
            (f"{ready} of {desired} ready; {failed_in_a_row} loads failed in a row; retrying {when}."),
        )
    elif starting or active > desired or (draining and active >= desired):
        state, message = "scaling", f"{ready} of {desired} ready, {starting} starting, {draining} draining."
        if move is not None:
            message += (
                f" Moving a replica from {move.from_worker.name} to {move.to_worker.name}, "
                f"which holds fewer of them; the extra one drains once the new one is ready."
            )
    elif report is not None:
        state, message = "waiting", f"{ready} of {desired} ready; {model.public_name} {report.reason}."
    else:
        state, message = "waiting", f"{ready} of {desired} ready; waiting for the next reconcile to place it."
    return DeploymentStatus(
        deployment_id=deployment.pk,
        model_name=model.public_name,
        desired_replicas=desired,
        ready=ready,
        starting=starting,
        draining=draining,
        state=state,
        last_error=last_error,
        message=message,
        error_detail=failure.last_error
        if failure and failure.last_error.strip() != error_cause(failure.last_error)
        else "",
        backoffs=[
            BackoffView(
                worker_name=b.worker.name,
                consecutive_failures=b.consecutive_failures,
                next_attempt_at=b.next_attempt_at,
                cause=error_cause(b.last_error),
            )
            for b in backoffs
        ],
    )


def workers_for_path_check(*, worker_ids: Iterable[int] | None = None) -> QuerySet[Worker]:
    """Workers a weight path can be checked on (all, or those of these): those not gone (online,
    draining or lost)."""
    workers = Worker.objects.exclude(state=Worker.State.OFFLINE)
    return workers if worker_ids is None else workers.filter(pk__in=list(worker_ids))


def workers_online() -> QuerySet[Worker]:
    """The workers online now, by name: those whose reports say what their checkpoints are now."""
    return Worker.objects.filter(state=Worker.State.ONLINE).order_by("name")


def workers_all() -> QuerySet[Worker]:
    """Every worker, whatever its state, by name."""
    return Worker.objects.all()


def worker_get(*, pk: int) -> Worker | None:
    return Worker.objects.filter(pk=pk).first()


def gpu_get_of_worker(*, pk: int, worker: Worker | None) -> Gpu | None:
    """The worker's GPU with this id (present or not); None when it is another worker's, or gone."""
    return Gpu.objects.filter(pk=pk, worker=worker).first()


def workers_online_with_present_gpus() -> QuerySet[Worker]:
    """Online workers, by name, each with `present_gpus` (by index) attached: where a replica can
    be loaded by hand."""
    return Worker.objects.filter(state=Worker.State.ONLINE).prefetch_related(
        Prefetch("gpus", queryset=Gpu.objects.filter(present=True), to_attr="present_gpus")
    )


def replicas_with_model_and_worker() -> QuerySet[Replica]:
    """Replicas with their deployment's model and their worker (the operators' actions name both)."""
    return Replica.objects.select_related("deployment__model", "worker")


def latest_quality_measurements(*, model_ids: Iterable[int]) -> dict[int, QualityMeasurement]:
    """Each of these models' latest quality measurement (with its worker), by model id."""
    latest: dict[int, QualityMeasurement] = {}
    for measurement in QualityMeasurement.objects.filter(model_id__in=list(model_ids)).select_related("worker"):
        latest.setdefault(measurement.model_id, measurement)  # newest first (the model's ordering)
    return latest


def models_with_fleet_status(*, model_ids: Iterable[int] | None = None) -> list[Model]:
    """Catalog models (all, or these), by public name, with their price tier and deployment, each
    with `fleet_status`: its deployment's DeploymentStatus (None when not deployed), so the catalog
    can say which are degraded and why, `quality_measurement` (its latest QualityMeasurement or
    None), and `perplexity_increase` (catalog.selectors: against its base
    model; None when not comparable) and `quality_refusal` (why its deployment may not place replicas,
    "" when it may) for the quality check."""
    models = Model.objects.select_related("price_tier", "deployment", "base_model").order_by("public_name")
    if model_ids is not None:
        models = models.filter(pk__in=list(model_ids))
    models = list(models)
    deployed = [m.deployment.pk for m in models if hasattr(m, "deployment")]
    statuses = {s.deployment_id: s for s in deployment_statuses(deployment_ids=deployed)} if deployed else {}
    latest = latest_quality_measurements(model_ids=[m.pk for m in models])
    for m in models:
        m.quality_measurement = latest.get(m.pk)
        m.fleet_status = statuses.get(m.deployment.pk) if hasattr(m, "deployment") else None
        m.perplexity_increase = perplexity_increase(model=m)
        m.quality_refusal = quality_refusal(deployment=m.deployment) if hasattr(m, "deployment") else ""
    return models


def workers_with_live_replicas(*, worker_ids: Iterable[int] | None = None) -> list[Worker]:
    """Workers (all, or these) with `present_gpus` and `live_replicas` (oldest first) attached,
    for the operators' fleet page."""
    workers = Worker.objects.prefetch_related(
        Prefetch("gpus", queryset=Gpu.objects.filter(present=True).order_by("index"), to_attr="present_gpus"),
        Prefetch(
            "replicas",
            to_attr="live_replicas",
            queryset=Replica.objects.filter(state__in=Replica.LIVE_STATES)
            .select_related("deployment__model", "gpu")
            .order_by("created_at", "pk"),
        ),
    )
    if worker_ids is not None:
        workers = workers.filter(pk__in=list(worker_ids))
    return list(workers)


def deployments_with_live_replicas(*, deployment_ids: Iterable[int] | None = None) -> list[Deployment]:
    """Deployments with their model and `live_replicas` (with worker and GPU) attached."""
    deployments = Deployment.objects.select_related("model", "autoscale_decision").prefetch_related(
        Prefetch(
            "replicas",
            to_attr="live_replicas",
            queryset=Replica.objects.filter(state__in=Replica.LIVE_STATES)
            .select_related("worker", "gpu")
            .order_by("created_at", "pk"),
        ),
    )
    if deployment_ids is not None:
        deployments = deployments.filter(pk__in=list(deployment_ids))
    return list(deployments)


def deployment_replica_loads(*, deployment: Deployment) -> tuple[int, list[ReplicaLoad]]:
    """How many replicas the deployment has active (pending, loading, ready), and the figures of
    each ready one from its worker's latest heartbeat (a ready replica no heartbeat reports yet is
    left out of the figures: nothing is known of its load)."""
    active = list(
        Replica.objects.filter(deployment=deployment, state__in=Replica.ACTIVE_STATES).values_list(
            "pk", "state", "worker_id"
        )
    )
    ready = [(pk, worker_id) for pk, state, worker_id in active if state == Replica.State.READY]
    latest = heartbeat_cache.read_many(worker_ids=sorted({worker_id for _, worker_id in ready}))
    loads = []
    for pk, worker_id in ready:
        figures = ((latest.get(worker_id) or {}).get("replicas") or {}).get(str(pk))
        if figures is not None:
            loads.append(
                ReplicaLoad(
                    running=float(figures.get("running") or 0.0),
                    waiting=float(figures.get("waiting") or 0.0),
                    kv_cache_usage=float(figures.get("kv_cache_usage") or 0.0),
                    ttft_p95_s=_figure(figures, "ttft_p95_s"),
                    itl_p95_s=_figure(figures, "itl_p95_s"),
                )
            )
    return len(active), loads


def replica_prefix_keys(heartbeats: dict[int, dict[str, Any]]) -> dict[int, frozenset[str]]:
    """By replica id, the conversations (gpuworker.contract.prefix_keys digests) whose KV its
    tiers hold, from its worker's latest heartbeat (`heartbeats`, by worker id, as
    heartbeat_cache.read_many answers)."""
    keys = {}
    for state in heartbeats.values():
        for replica_id, figures in (state.get("replicas") or {}).items():
            if figures.get("prefix_keys"):
                keys[int(replica_id)] = frozenset(figures["prefix_keys"])
    return keys


def _figure(figures: dict[str, Any], name: str) -> float | None:
    value = figures.get(name)
    return None if value is None else float(value)


@dataclass(frozen=True)
class FleetHealth:
    """The fleet at a glance, for the operators' home page."""

    workers_by_state: dict[str, int]
    gpus_present: int
    gpus_busy: int  # present GPUs holding at least one live replica
    # Mean GPU utilisation over the GPUs the latest heartbeats report (None: no GPU reports one).
    gpu_utilisation_pct: float | None
    replicas_failed_recently: int
    not_ready: list[DeploymentStatus]  # deployments that want replicas and lack some (or have errors)


def fleet_health(*, now: datetime, failures_since: datetime) -> FleetHealth:
    workers = dict(Worker.objects.order_by().values_list("state").annotate(n=Count("pk")).values_list("state", "n"))
    gpus = Gpu.objects.filter(present=True)
    present = set(gpus.values_list("worker_id", "index"))
    held = {
        (worker_id, index)
        for worker_id, first, size, _ in live_replica_placements(worker_ids=Worker.objects.values_list("pk", flat=True))
        for index in held_gpu_indexes(first_index=first, tensor_parallel_size=size)
    }
    live = heartbeat_cache.read_many(
        worker_ids=list(Worker.objects.exclude(state=Worker.State.OFFLINE).values_list("pk", flat=True))
    )
    utilisation = [
        float(gpu["utilization_pct"])
        for beat in live.values()
        for gpu in beat.get("gpus") or ()
        if gpu.get("utilization_pct") is not None
    ]
    return FleetHealth(
        workers_by_state={state: workers.get(state, 0) for state in Worker.State.values},
        gpus_present=len(present),
        gpus_busy=len(held & present),
        gpu_utilisation_pct=sum(utilisation) / len(utilisation) if utilisation else None,
        replicas_failed_recently=Replica.objects.filter(
            state=Replica.State.FAILED, state_changed_at__gte=failures_since
        ).count(),
        not_ready=[s for s in deployment_statuses(now=now) if s.state not in ("ready", "stopped")],
    )


def gpu_seconds_by_model(*, since: datetime, until: datetime) -> dict[str, float]:
    """Seconds each model's replicas held a GPU within [since, until), by the model's public name.

    A replica holds its GPU from placement (`created_at`: placement reserves the GPU's memory for
    it, and loading already occupies the device) until it ends (`state_changed_at` of a stopped or
    failed replica; a live replica still holds it at `until`). These are the replica's own
    recorded transitions, which heartbeats drive; replicas on a worker's CPU hold no GPU and are
    left out. This is capacity held, not busy time: the engine's busy share is each usage record's
    `gpu_time_s`. A replica split over N GPUs holds N GPU-seconds a second."""
    ended = (Replica.State.STOPPED, Replica.State.FAILED)
    replicas = (
        Replica.objects.filter(gpu__isnull=False, created_at__lt=until)
        .exclude(state__in=ended, state_changed_at__lte=since)
        .values_list(
            "deployment__model__public_name", "created_at", "state", "state_changed_at", "tensor_parallel_size"
        )
    )
    seconds: dict[str, float] = {}
    for model_name, created_at, state, changed_at, gpus in replicas:
        end = min(changed_at, until) if state in ended else until
        held = (end - max(created_at, since)).total_seconds()
        if held > 0:
            seconds[model_name] = seconds.get(model_name, 0.0) + held * gpus
    return seconds


def gpu_busy_seconds_by_model(*, since: datetime, until: datetime) -> dict[str, float]:
    """GPU-seconds each model's requests kept their replicas busy, for requests recorded within
    [since, until), by the model's public name: each usage record's `gpu_time_s` (its share, by
    tokens, of every engine step it took part in) times the GPUs its replica spans. A record
    without a replica (refused before routing) or without a figure counts nothing; replicas on a
    worker's CPU count as one device, so the embedded demo shows its figures too."""
    gpus = Coalesce(F("replica__tensor_parallel_size"), Value(1))
    rows = (
        UsageRecord.objects.filter(created_at__gte=since, created_at__lt=until, gpu_time_s__isnull=False)
        .values("model__public_name")
        .annotate(seconds=Sum(F("gpu_time_s") * gpus, output_field=FloatField()))
        .values_list("model__public_name", "seconds")
    )
    return {model_name: seconds for model_name, seconds in rows if seconds}
