"""HTML fragments the fleet page's WebSocket sends, each addressed by element id (htmx's ws
extension swaps it in place): a heartbeat's figures and load progress, a worker's card after a
replica change, the whole worker list after a worker comes or goes, a deployment's status."""

from typing import Any

from django.template.loader import render_to_string

from controlplane.dashboard.ops.overview import (
    FigureHistory,
    deployment_views,
    heartbeat_time,
    live_slot_updates,
    loading_progress,
    staging_view,
    worker_views,
)


def heartbeat_fragment(live: dict[str, Any], history: FigureHistory) -> str:
    """No database work: figures and load progress come straight from the heartbeat."""
    progress = [(replica_id, round(100 * share)) for replica_id, share in loading_progress(live)]
    return render_to_string("dashboard/ops/_heartbeat.html", {
        "slots": live_slot_updates(live, history), "progress": progress,
        "worker_id": live["worker_id"], "heartbeat_at": heartbeat_time(live), "staging": staging_view(live),
    })


def workers_fragment(history: FigureHistory) -> str:
    return render_to_string("dashboard/ops/_workers.html", {"workers": worker_views(history=history)})


def replica_change_fragment(data: dict[str, Any], history: FigureHistory) -> str:
    parts = []
    workers = worker_views(worker_ids=[data["worker_id"]], history=history)
    for view in workers:
        parts.append(render_to_string("dashboard/ops/_worker.html", {"w": view}))
    for view in deployment_views(deployment_ids=[data["deployment_id"]]):
        parts.append(render_to_string("dashboard/ops/_deployment_status.html", {"view": view}))
    return "".join(parts)
