"""HTML fragments the fleet page's WebSocket sends, each addressed by element id (htmx's ws
extension swaps it in place): a heartbeat's figures and load progress, a worker's card after a
replica change, the whole worker list after a worker comes or goes, a deployment's status after
any change to it, the whole deployment list after one is created, and a deployment's latest
autoscaling decision."""

from typing import Any

from django.template.loader import render_to_string

from controlplane.dashboard.ops.forms import DeploymentLimitsForm, ScaleForm
from controlplane.dashboard.ops.overview import (
    FigureHistory,
    autoscale_view_from_event,
    deployment_views,
    heartbeat_time,
    live_slot_updates,
    loading_progress,
    replica_loads,
    staging_view,
    worker_views,
)


def heartbeat_fragment(live: dict[str, Any], history: FigureHistory) -> str:
    """No database work: figures and load progress come straight from the heartbeat."""
    progress = [(replica_id, round(100 * share)) for replica_id, share in loading_progress(live)]
    return render_to_string("dashboard/ops/_heartbeat.html", {
        "slots": live_slot_updates(live, history), "progress": progress,
        "worker_id": live["worker_id"], "heartbeat_at": heartbeat_time(live), "replica_loads": replica_loads(live),
        "staging": staging_view(live),
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


def autoscale_fragment(data: dict[str, Any]) -> str:
    """The deployment's latest autoscaling decision, straight from the event (no database work)."""
    return render_to_string("dashboard/ops/_autoscale.html", {"a": autoscale_view_from_event(data)})


def resync_fragment(history: FigureHistory) -> str:
    """Everything live on the page as it is now (a page that lost its connection missed events):
    the worker list and each deployment's status; forms are left alone."""
    parts = [workers_fragment(history)]
    parts += [render_to_string("dashboard/ops/_deployment_status.html", {"view": view}) for view in deployment_views()]
    return "".join(parts)


def deployment_context(view, *, scale_form=None, limits_form=None, open_limits=False) -> dict:
    """What _deployment.html needs: the view and its forms, filled with the current settings
    unless a refused submission's forms are given."""
    deployment = view.deployment
    return {
        "view": view,
        "scale_form": scale_form or ScaleForm(initial={"desired_replicas": deployment.desired_replicas},
                                              prefix=f"s{deployment.pk}"),
        "limits_form": limits_form or DeploymentLimitsForm.for_deployment(deployment),
        "open_limits": open_limits,
    }


def deployment_fragment(data: dict[str, Any]) -> str:
    """A deployment changed: the whole list when it is new (the page has no element for it yet),
    else its status, which shows its settings. Its forms are left alone: replacing them could
    wipe what an operator is typing."""
    if data.get("created"):
        return render_to_string("dashboard/ops/_deployments.html", {
            "deployments": [deployment_context(view) for view in deployment_views()]})
    return "".join(render_to_string("dashboard/ops/_deployment_status.html", {"view": view})
                   for view in deployment_views(deployment_ids=[data["deployment_id"]]))
