"""Celery tasks for the fleet; each calls a service. Beat runs them periodically (settings).

Celery's own per-task lines are at DEBUG (`controlplane.routine_logs`): a task logs at INFO only
when it changed something, so an idle fleet's log stays quiet."""

import logging

from celery import shared_task
from django.utils import timezone

from controlplane.fleet.reconcile import fleet_reconcile
from controlplane.fleet.services.autoscaling import deployments_autoscale
from controlplane.fleet.services.heartbeats import workers_mark_lost
from controlplane.fleet.services.staging import workers_stage_weights
from controlplane.integrations import unreachable_dependency

logger = logging.getLogger(__name__)


@shared_task(name="controlplane.fleet.tasks.mark_lost_workers")
def mark_lost_workers() -> int:
    """Workers that stopped sending heartbeats become lost and their replicas are replaced."""
    try:
        changed = workers_mark_lost(now=timezone.now())
    except Exception as exc:
        if (dependency := unreachable_dependency(exc)) is None:
            raise
        # The next check that runs tells from the gap whether its watch must start again (lost_watch.py).
        logger.warning("lost-worker judgement paused: the %s is unreachable (%s)", dependency, type(exc).__name__)
        return 0
    if changed:
        logger.info("%d silent worker(s) marked lost or offline", changed)
    return changed


@shared_task(name="controlplane.fleet.tasks.reconcile")
def reconcile(deployment_ids: list[int] | None = None) -> dict[str, int]:
    """Bring deployments (all when None) to their desired replicas; returns what it did, in counts."""
    outcomes = fleet_reconcile(now=timezone.now(), deployment_ids=deployment_ids)
    # The periodic (whole-fleet) run also refreshes what workers keep warm for fast scale-ups.
    if deployment_ids is None:
        workers_stage_weights()
    counts = {
        "placed": sum(len(o.placed) for o in outcomes),
        "removed": sum(len(o.removed) for o in outcomes),
        "unplaced": sum(o.unplaced for o in outcomes),
    }
    if counts["placed"] or counts["removed"]:
        logger.info("reconcile: %(placed)d replica(s) placed, %(removed)d removed, %(unplaced)d unplaced", counts)
    return counts


@shared_task(name="controlplane.fleet.tasks.autoscale")
def autoscale() -> dict[str, int]:
    """One autoscaling decision per deployment (beat, AUTOSCALE_INTERVAL_SECONDS); counts by action."""
    decisions = deployments_autoscale(now=timezone.now())
    counts = {action: sum(1 for d in decisions if d.action == action) for action in ("up", "down", "hold")}
    if counts["up"] or counts["down"]:
        logger.info("autoscale: %(up)d deployment(s) scaled up, %(down)d down", counts)
    return counts
