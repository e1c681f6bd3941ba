"""The autoscaler's writes: one decision per deployment per tick (Celery beat, tasks.autoscale), made
by the pure policy in fleet/autoscaling.py from the heartbeats' figures and the gateways' traffic
counts (fleet/traffic.py), stored and published; a change goes through the operators' scale path."""

import logging
from datetime import datetime

from django.conf import settings
from django.db import transaction

from controlplane import live_events
from controlplane.catalog.models import Deployment
from controlplane.fleet.autoscaling import AutoscalePolicy, Decision, DeploymentSignals, decide, popular
from controlplane.fleet.cold_start_counts import cold_start_waiting
from controlplane.fleet.models import AutoscaleDecision
from controlplane.fleet.selectors import deployment_replica_loads
from controlplane.fleet.services.deployments import deployment_scale_locked
from controlplane.fleet.traffic import TrafficSnapshot, traffic_snapshot

logger = logging.getLogger(__name__)


def autoscale_policy(deployment: Deployment) -> AutoscalePolicy:
    """A deployment's policy: its own fields, and the fleet-wide settings."""
    return AutoscalePolicy(
        min_replicas=deployment.min_replicas,
        max_replicas=deployment.max_replicas,
        keep_warm=deployment.keep_warm,
        target_concurrency=float(deployment.target_concurrency),
        target_utilisation=settings.AUTOSCALE_TARGET_UTILISATION_PERCENT / 100,
        hysteresis=settings.AUTOSCALE_HYSTERESIS_PERCENT / 100,
        ttft_slo_s=deployment.ttft_slo_ms / 1000,
        itl_slo_s=deployment.itl_slo_ms / 1000,
        kv_cache_high=settings.AUTOSCALE_KV_CACHE_HIGH_PERCENT / 100,
        scale_up_cooldown_s=float(settings.AUTOSCALE_SCALE_UP_COOLDOWN_SECONDS),
        scale_down_cooldown_s=float(settings.AUTOSCALE_SCALE_DOWN_COOLDOWN_SECONDS),
        idle_to_zero_s=float(deployment.idle_to_zero_seconds),
    )


def deployments_autoscale(*, now: datetime) -> list[AutoscaleDecision]:
    """Decide once for every deployment with autoscaling on. Without the gateway's counts (Redis
    down) nothing is decided: no traffic seen must not read as no traffic, which scales to zero."""
    rows = list(
        Deployment.objects.filter(autoscale=True, model__enabled=True).order_by("pk").values_list("pk", "model_id")
    )
    try:
        traffic = traffic_snapshot(
            now=now.timestamp(),
            rate_window_s=settings.AUTOSCALE_RATE_WINDOW_SECONDS,
            popular_window_s=settings.AUTOSCALE_POPULAR_WINDOW_SECONDS,
        )
        queued = cold_start_waiting(model_ids=[model_id for _, model_id in rows])
    except Exception:
        logger.warning("autoscaler: the gateway's traffic counts are unreadable; no decisions this tick", exc_info=True)
        return []
    popular_models = popular(traffic.window_counts, settings.AUTOSCALE_POPULAR_TOP_K)
    decisions = [
        deployment_autoscale(
            deployment_id=pk,
            now=now,
            traffic=traffic,
            popular_models=popular_models,
            queued_cold_starts=queued.get(model_id, 0),
        )
        for pk, model_id in rows
    ]
    return [d for d in decisions if d is not None]


@transaction.atomic
def deployment_autoscale(
    *,
    deployment_id: int,
    now: datetime,
    traffic: TrafficSnapshot,
    popular_models: set[int],
    queued_cold_starts: int = 0,
) -> AutoscaleDecision | None:
    """One decision for one deployment, under its row lock (an operator's scale waits, then counts
    for the cooldown). A change goes through the same path as an operator's scale, audited as the
    system's with the decision's reason and inputs; every decision is stored and published."""
    deployment = Deployment.objects.select_for_update().select_related("model").filter(pk=deployment_id).first()
    if deployment is None or not deployment.autoscale:
        return None
    model_id = deployment.model_id
    current, loads = deployment_replica_loads(deployment=deployment)
    signals = DeploymentSignals(
        now=now.timestamp(),
        current_replicas=current,
        loads=tuple(loads),
        request_rate_per_s=traffic.rate_per_s.get(model_id, 0.0),
        last_request_at=traffic.last_request_at.get(model_id),
        last_scaled_at=deployment.scaled_at.timestamp() if deployment.scaled_at else None,
        popular=model_id in popular_models,
        queued_cold_starts=queued_cold_starts,
        shed_rate_per_s=traffic.shed_rate_per_s.get(model_id, 0.0),
    )
    decision = decide(autoscale_policy(deployment), signals)
    applied = _autoscale_apply(deployment=deployment, decision=decision, now=now)
    stored, _ = AutoscaleDecision.objects.update_or_create(
        deployment=deployment,
        defaults={
            "action": applied,
            "desired_replicas": deployment.desired_replicas,
            "reason": decision.reason[:500],
            "inputs": decision.inputs,
            "decided_at": now,
        },
    )
    live_events.publish(
        group=live_events.FLEET_GROUP,
        event="autoscale.decision",
        data={
            "deployment_id": deployment.pk,
            "action": applied,
            "desired_replicas": deployment.desired_replicas,
            "reason": stored.reason,
            "inputs": decision.inputs,
            "decided_at": now.timestamp(),
        },
    )
    return stored


def _autoscale_apply(*, deployment: Deployment, decision: Decision, now: datetime) -> str:
    """Move desired replicas only the way the decision points: the policy counts active replicas,
    which lag desired ones (still placing, or no room), and must not undo a wish it agrees with."""
    before = deployment.desired_replicas
    if decision.action == "up" and decision.desired > before or decision.action == "down" and decision.desired < before:
        deployment_scale_locked(
            deployment=deployment,
            desired_replicas=decision.desired,
            actor=None,
            now=now,
            detail={"autoscaler": decision.reason, "inputs": decision.inputs},
        )
        return decision.action
    return AutoscaleDecision.Action.HOLD.value
