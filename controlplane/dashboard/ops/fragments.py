"""The fleet page's live parts, rendered here and only here: a heartbeat's figures and load
progress, a worker's card after a replica change, the whole worker list after a worker comes or
goes, a deployment's status after any change to it, the whole deployment list after one is
created, and a deployment's latest autoscaling decision. The page's WebSocket sends them, each
addressed by element id (htmx's ws extension swaps it in place); a page whose socket is down
fetches the same resync over HTTP (`oob`: each marked for htmx to swap in by id).

The forms on the page are not live: a form's own answer replaces it (views.py), so a push never
wipes what an operator is typing, and no part of the page is drawn by both."""

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


def heartbeat_fragment(live: dict[str, Any], history: FigureHistory, tenant_names: dict[int, str]) -> str:
    """No database work: figures and load progress come straight from the heartbeat;
    `tenant_names` (the caller's, from accounts' cache) name the tenants of its replicas' shares."""
    progress = [(replica_id, round(100 * share)) for replica_id, share in loading_progress(live)]
    return render_to_string(
        "dashboard/ops/_heartbeat.html",
        {
            "slots": live_slot_updates(live, history),
            "progress": progress,
            "worker_id": live["worker_id"],
            "heartbeat_at": heartbeat_time(live),
            "replica_loads": replica_loads(live, tenant_names),
            "staging": staging_view(live),
        },
    )


def workers_fragment(history: FigureHistory, *, oob: bool = False) -> str:
    return render_to_string("dashboard/ops/_workers.html", {"workers": worker_views(history=history), "oob": oob})


def deployment_status_fragment(*, deployment_ids: list[int] | None = None, oob: bool = False) -> str:
    """The deployments' (all, or these) statuses: counts, settings, replicas, failed loads."""
    return "".join(
        render_to_string("dashboard/ops/_deployment_status.html", {"view": view, "oob": oob})
        for view in deployment_views(deployment_ids=deployment_ids)
    )


def replica_change_fragment(data: dict[str, Any], history: FigureHistory) -> str:
    parts = [
        render_to_string("dashboard/ops/_worker.html", {"w": view})
        for view in worker_views(worker_ids=[data["worker_id"]], history=history)
    ]
    parts.append(deployment_status_fragment(deployment_ids=[data["deployment_id"]]))
    return "".join(parts)


def autoscale_fragment(data: dict[str, Any]) -> str:
    """The deployment's latest autoscaling decision, straight from the event (no database work)."""
    return render_to_string("dashboard/ops/_autoscale.html", {"a": autoscale_view_from_event(data)})


def resync_fragment(history: FigureHistory, *, oob: bool = False) -> str:
    """Everything live on the page as it is now (a page that lost its connection missed events):
    the worker list and each deployment's status; forms are left alone."""
    return workers_fragment(history, oob=oob) + deployment_status_fragment(oob=oob)


def deployment_context(view) -> dict:
    """What _deployment.html needs: the view, its forms filled with the current settings, and the
    id of its answer line."""
    deployment = view.deployment
    return {
        "view": view,
        "scale_form": ScaleForm.for_deployment(deployment),
        "limits_form": DeploymentLimitsForm.for_deployment(deployment),
        "open_limits": False,
        "answer_id": deployment_answer_id(deployment.pk),
    }


def deployment_answer_id(deployment_id: int) -> str:
    """The element id of a deployment's answer line (_answer.html), where "retry now" answers."""
    return f"deployment-{deployment_id}-answer"


def deployments_fragment() -> str:
    """The whole deployment list, each card with its forms: for the page, and after a deployment
    is created (the page has no element for it yet)."""
    return render_to_string(
        "dashboard/ops/_deployments.html", {"deployments": [deployment_context(view) for view in deployment_views()]}
    )


def deployment_fragment(data: dict[str, Any]) -> str:
    """A deployment changed: the whole list when it is new, else its status, which shows its
    settings. Its forms are left alone: replacing them could wipe what an operator is typing."""
    if data.get("created"):
        return deployments_fragment()
    return deployment_status_fragment(deployment_ids=[data["deployment_id"]])
