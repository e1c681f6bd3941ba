"""Weight staging: which checkpoints each online worker keeps warm for fast loads (the pure plan in
fleet/staging.py, busiest models first by the gateways' traffic counts), sent when a list changes."""

import logging

from django.conf import settings
from django.utils import timezone

from controlplane.catalog.models import Deployment
from controlplane.fleet import commands, heartbeat_cache
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.staging import StagingCandidate, StagingWorker, plan_staging
from controlplane.fleet.traffic import traffic_snapshot
from gpuworker.contract.tasks import StageWeights

logger = logging.getLogger(__name__)


def workers_stage_weights() -> dict[int, tuple[str, ...]]:
    """Send each online worker the checkpoints it should keep warm (plan_staging), only when its
    list changed since the last one sent. Returns the lists sent, by worker id."""
    workers = list(Worker.objects.filter(state=Worker.State.ONLINE))
    latest = heartbeat_cache.read_many(worker_ids=[w.pk for w in workers])
    running: dict[int, set[str]] = {}
    for worker_id, path in Replica.objects.filter(worker__in=workers, state__in=Replica.LIVE_STATES).values_list(
        "worker_id", "deployment__model__weights_path"
    ):
        running.setdefault(worker_id, set()).add(path)
    staging_workers = [
        StagingWorker(
            worker_id=w.pk,
            budget_bytes=int(((latest.get(w.pk) or {}).get("staging") or {}).get("budget_bytes", 0)),
            model_paths=frozenset(w.model_paths or ()),
            running_paths=frozenset(running.get(w.pk, ())),
        )
        for w in workers
    ]
    try:  # busiest first: requests over the popularity window, as the gateways counted them
        traffic = traffic_snapshot(
            now=timezone.now().timestamp(),
            rate_window_s=settings.AUTOSCALE_RATE_WINDOW_SECONDS,
            popular_window_s=settings.AUTOSCALE_POPULAR_WINDOW_SECONDS,
        ).window_counts
    except Exception:
        logger.warning("staging: the gateway's traffic counts are unreadable; nothing sent this time", exc_info=True)
        return {}
    candidates = [
        StagingCandidate(
            model_path=d.model.weights_path,
            weight_bytes=d.model.gpu_memory_bytes,
            traffic=float(traffic.get(d.model_id, 0.0)),
            headroom=d.desired_replicas < d.max_replicas,
        )
        for d in Deployment.objects.select_related("model").filter(model__enabled=True)
    ]
    sent = {}
    queues = {w.pk: w.queue_name for w in workers}
    for worker_id, paths in plan_staging(staging_workers, candidates).items():
        if heartbeat_cache.staging_sent(worker_id=worker_id) == list(paths):
            continue
        commands.send_to_worker(queue=queues[worker_id], task=StageWeights(model_paths=paths))
        heartbeat_cache.store_staging_sent(worker_id=worker_id, model_paths=list(paths))
        sent[worker_id] = paths
    return sent
