"""The fleet's Prometheus gauges, read from the database and the heartbeat cache when /metrics is
scraped (so every web process answers the same, and nothing is kept between scrapes): live
replicas per model and state, desired replicas per deployment, workers per state, how long ago
each worker was last heard from, and whether the lost-worker judgement is paused."""

import logging

from django.db import DatabaseError
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from controlplane.fleet.lost_watch import PAUSE_REASONS
from controlplane.fleet.models import Worker
from controlplane.fleet.selectors import (
    deployments_desired_replicas,
    lost_judgement,
    replica_counts_by_model_and_state,
    workers_heard_from,
)
from controlplane.integrations import unreachable_dependency

logger = logging.getLogger(__name__)


class FleetCollector:
    """A prometheus-client collector; each scrape runs a few small queries. With the database
    down the scrape still answers (the gateway's figures, kept in memory, are there) and
    `gpuserve_fleet_metrics_up` says 0."""

    def collect(self):
        try:
            families = list(self._families())
        except DatabaseError:
            logger.warning("/metrics: the fleet's figures are unreadable (database)", exc_info=True)
            families = []
        up = GaugeMetricFamily("gpuserve_fleet_metrics_up", "1 if the fleet's figures below could be read, else 0.")
        up.add_metric([], 1 if families else 0)
        yield up
        yield from families
        yield from self._judgement_families()

    def _judgement_families(self):
        """Whether the lost-worker judge is paused, and why (from the cache only: these matter most
        while the database is down)."""
        try:
            judgement = lost_judgement(now=timezone.now())
        except Exception as exc:
            if unreachable_dependency(exc) is None:
                raise
            logger.warning("/metrics: the lost-worker judgement is unreadable (%s)", type(exc).__name__)
            return
        paused = GaugeMetricFamily(
            "gpuserve_fleet_lost_judgement_paused",
            "1 while workers cannot be judged lost, by reason: check_not_running (no check completed for a "
            "lost window), watch_resumed (the check came back less than a lost window ago), replicas_answer "
            "(a silent worker's replicas answer: its heartbeats go unrecorded).",
            labels=["reason"],
        )
        for reason in PAUSE_REASONS:
            paused.add_metric([reason], 1 if reason in judgement.paused_reasons else 0)
        yield paused
        if judgement.checked_at is not None:
            checked = GaugeMetricFamily(
                "gpuserve_fleet_lost_check_timestamp_seconds", "When the lost-worker check last completed (Unix time)."
            )
            checked.add_metric([], judgement.checked_at)
            yield checked

    def _families(self):
        replicas = GaugeMetricFamily(
            "gpuserve_replicas", "Live replicas by model and state.", labels=["model", "state"]
        )
        for (model, state), count in sorted(replica_counts_by_model_and_state().items()):
            replicas.add_metric([model, str(state)], count)
        yield replicas

        desired = GaugeMetricFamily(
            "gpuserve_deployment_desired_replicas",
            "Replicas each deployment wants (set by operators and the autoscaler).",
            labels=["model"],
        )
        for model, count in deployments_desired_replicas():
            desired.add_metric([model], count)
        yield desired

        heard_from = workers_heard_from(now=timezone.now())
        workers = GaugeMetricFamily(
            "gpuserve_workers", "GPU worker daemons by state (offline ones left out).", labels=["state"]
        )
        for state in (Worker.State.ONLINE, Worker.State.DRAINING, Worker.State.LOST):
            workers.add_metric([str(state)], sum(1 for worker, _ in heard_from if worker.state == state))
        yield workers

        age = GaugeMetricFamily(
            "gpuserve_worker_heartbeat_age_seconds",
            "Seconds since each worker's last heartbeat (offline workers left out).",
            labels=["worker"],
        )
        for worker, seconds in heard_from:
            age.add_metric([worker.name], max(0.0, seconds))
        yield age
