"""The fleet's Prometheus gauges, read from the database and the heartbeat cache when /metrics is
scraped (so every web process answers the same, and nothing is kept between scrapes): live
replicas per model and state, desired replicas per deployment, workers per state, and how long
ago each worker was last heard from."""

import logging

from django.db import DatabaseError
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from controlplane.fleet.models import Worker
from controlplane.fleet.selectors import (
    deployments_desired_replicas,
    replica_counts_by_model_and_state,
    workers_heard_from,
)

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

    def _families(self):
        replicas = GaugeMetricFamily("gpuserve_replicas", "Live replicas by model and state.",
                                     labels=["model", "state"])
        for (model, state), count in sorted(replica_counts_by_model_and_state().items()):
            replicas.add_metric([model, str(state)], count)
        yield replicas

        desired = GaugeMetricFamily("gpuserve_deployment_desired_replicas",
                                    "Replicas each deployment wants (set by operators and the autoscaler).",
                                    labels=["model"])
        for model, count in deployments_desired_replicas():
            desired.add_metric([model], count)
        yield desired

        heard_from = workers_heard_from(now=timezone.now())
        workers = GaugeMetricFamily("gpuserve_workers", "GPU worker daemons by state (offline ones left out).",
                                    labels=["state"])
        for state in (Worker.State.ONLINE, Worker.State.DRAINING, Worker.State.LOST):
            workers.add_metric([str(state)], sum(1 for worker, _ in heard_from if worker.state == state))
        yield workers

        age = GaugeMetricFamily("gpuserve_worker_heartbeat_age_seconds",
                                "Seconds since each worker's last heartbeat (offline workers left out).",
                                labels=["worker"])
        for worker, seconds in heard_from:
            age.add_metric([worker.name], max(0.0, seconds))
        yield age
