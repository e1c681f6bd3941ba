"""Reads for the fleet: ready replicas, free capacity for placement, each worker's latest heartbeat,
and each deployment's status and last error for the operators' pages."""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Prefetch, Q, QuerySet, Sum

from controlplane.catalog.models import Deployment, Model
from controlplane.fleet import heartbeat_cache
from controlplane.fleet.autoscaling import ReplicaLoad
from controlplane.fleet.models import Gpu, Replica, Worker
from controlplane.fleet.placement import Slot


def replicas_ready_for_model(*, model) -> QuerySet[Replica]:
    """Replicas that can take requests for `model` right now, on workers that are online."""
    return Replica.objects.filter(
        deployment__model=model, state=Replica.State.READY, worker__state=Worker.State.ONLINE
    ).select_related("worker", "gpu")


def worker_latest_heartbeat(*, worker_id: int) -> dict[str, Any] | None:
    """The worker's latest heartbeat as stored (figures per GPU, CPU and replica), or None."""
    return heartbeat_cache.read(worker_id=worker_id)


def workers_latest_heartbeats(*, worker_ids: Iterable[int]) -> dict[int, dict[str, Any]]:
    return heartbeat_cache.read_many(worker_ids=list(worker_ids))


def placement_slots(*, workers: list[Worker]) -> list[Slot]:
    """Where replicas can go on these workers: each present GPU, or a CPU-only worker's memory,
    with the memory its live replicas are estimated to use (their models' gpu_memory_bytes)."""
    ids = [worker.pk for worker in workers]
    used = {
        (row["worker_id"], row["gpu_id"]): row["used"]
        for row in Replica.objects.filter(worker_id__in=ids, state__in=Replica.LIVE_STATES)
        .values("worker_id", "gpu_id").annotate(used=Sum("deployment__model__gpu_memory_bytes"))
    }
    slots = [
        Slot(worker_id=gpu.worker_id, gpu_id=gpu.pk, gpu_index=gpu.index,
             total_bytes=gpu.memory_total_bytes, used_bytes=used.get((gpu.worker_id, gpu.pk), 0))
        for gpu in Gpu.objects.filter(worker_id__in=ids, present=True).order_by("worker_id", "index")
    ]
    slots += [
        Slot(worker_id=worker.pk, gpu_id=None, gpu_index=None,
             total_bytes=worker.cpu_memory_total_bytes, used_bytes=used.get((worker.pk, None), 0))
        for worker in workers if worker.device == Worker.Device.CPU
    ]
    return slots


def deployment_get_for_model(*, model: Model) -> Deployment | None:
    return Deployment.objects.filter(model=model).first()


def workers_where_model_failed(*, deployment: Deployment) -> set[int]:
    """Workers where this deployment's model failed to load since the model last changed: reconcile
    does not place it there again (a bad weight path must not become a retry loop)."""
    return set(Replica.objects.filter(
        deployment=deployment, failure=Replica.Failure.LOAD, state_changed_at__gte=deployment.model.updated_at,
    ).values_list("worker_id", flat=True))


@dataclass(frozen=True)
class DeploymentStatus:
    deployment_id: int
    model_name: str
    desired_replicas: int
    ready: int
    starting: int  # pending or loading
    draining: int
    # ready, scaling (replicas starting or being removed), stopped (none wanted, none left),
    # failed (too few, nothing starting, and the last attempt failed) or waiting (too few and no
    # worker has room).
    state: str
    last_error: str
    message: str


def deployment_statuses(*, deployment_ids: Iterable[int] | None = None) -> list[DeploymentStatus]:
    S = Replica.State
    deployments = Deployment.objects.select_related("model").annotate(
        n_ready=Count("replicas", filter=Q(replicas__state=S.READY)),
        n_starting=Count("replicas", filter=Q(replicas__state__in=[S.PENDING, S.LOADING])),
        n_draining=Count("replicas", filter=Q(replicas__state=S.DRAINING)),
    )
    if deployment_ids is not None:
        deployments = deployments.filter(pk__in=list(deployment_ids))
    return [_status(d) for d in deployments]


def _status(deployment) -> DeploymentStatus:
    ready, starting, draining = deployment.n_ready, deployment.n_starting, deployment.n_draining
    desired, model = deployment.desired_replicas, deployment.model
    failure = (Replica.objects.filter(deployment=deployment, state=Replica.State.FAILED,
                                      state_changed_at__gte=model.updated_at)
               .order_by("-state_changed_at").select_related("worker").first())
    last_error = f"{failure.worker.name}: {failure.last_error}" if failure else ""
    active = ready + starting
    if desired == 0 and active + draining == 0:
        state, message = "stopped", "No replicas wanted."
    elif ready == desired == active and not draining:
        state, message = "ready", f"{ready} of {desired} replicas ready."
    elif starting or active > desired or (draining and active >= desired):
        state, message = "scaling", f"{ready} of {desired} ready, {starting} starting, {draining} draining."
    elif failure is not None and failure.failure in (Replica.Failure.LOAD, Replica.Failure.CRASHED):
        state, message = "failed", f"{ready} of {desired} ready; loading failed on every worker it was tried on."
    else:
        state, message = "waiting", (f"{ready} of {desired} ready; no online worker has "
                                     f"{model.gpu_memory_bytes:,} bytes free for {model.public_name}.")
    return DeploymentStatus(
        deployment_id=deployment.pk, model_name=model.public_name, desired_replicas=desired,
        ready=ready, starting=starting, draining=draining, state=state, last_error=last_error, message=message,
    )


def workers_for_path_check() -> QuerySet[Worker]:
    """Workers a weight path can be checked on: those not gone (online, draining or lost)."""
    return Worker.objects.exclude(state=Worker.State.OFFLINE)


def workers_with_live_replicas(*, worker_ids: Iterable[int] | None = None) -> list[Worker]:
    """Workers (all, or these) with `present_gpus` and `live_replicas` (oldest first) attached,
    for the operators' fleet page."""
    workers = Worker.objects.prefetch_related(
        Prefetch("gpus", queryset=Gpu.objects.filter(present=True).order_by("index"), to_attr="present_gpus"),
        Prefetch("replicas", to_attr="live_replicas", queryset=Replica.objects.filter(state__in=Replica.LIVE_STATES)
                 .select_related("deployment__model").order_by("created_at", "pk")),
    )
    if worker_ids is not None:
        workers = workers.filter(pk__in=list(worker_ids))
    return list(workers)


def deployments_with_live_replicas(*, deployment_ids: Iterable[int] | None = None) -> list[Deployment]:
    """Deployments with their model and `live_replicas` (with worker and GPU) attached."""
    deployments = Deployment.objects.select_related("model", "autoscale_decision").prefetch_related(
        Prefetch("replicas", to_attr="live_replicas", queryset=Replica.objects.filter(state__in=Replica.LIVE_STATES)
                 .select_related("worker", "gpu").order_by("created_at", "pk")),
    )
    if deployment_ids is not None:
        deployments = deployments.filter(pk__in=list(deployment_ids))
    return list(deployments)


def deployment_replica_loads(*, deployment: Deployment) -> tuple[int, list[ReplicaLoad]]:
    """How many replicas the deployment has active (pending, loading, ready), and the figures of
    each ready one from its worker's latest heartbeat (a ready replica no heartbeat reports yet is
    left out of the figures: nothing is known of its load)."""
    active = list(Replica.objects.filter(deployment=deployment, state__in=Replica.ACTIVE_STATES)
                  .values_list("pk", "state", "worker_id"))
    ready = [(pk, worker_id) for pk, state, worker_id in active if state == Replica.State.READY]
    latest = heartbeat_cache.read_many(worker_ids=sorted({worker_id for _, worker_id in ready}))
    loads = []
    for pk, worker_id in ready:
        figures = ((latest.get(worker_id) or {}).get("replicas") or {}).get(str(pk))
        if figures is not None:
            loads.append(ReplicaLoad(
                running=float(figures.get("running") or 0.0), waiting=float(figures.get("waiting") or 0.0),
                kv_cache_usage=float(figures.get("kv_cache_usage") or 0.0),
                ttft_p95_s=_figure(figures, "ttft_p95_s"), itl_p95_s=_figure(figures, "itl_p95_s"),
            ))
    return len(active), loads


def _figure(figures: dict[str, Any], name: str) -> float | None:
    value = figures.get(name)
    return None if value is None else float(value)
