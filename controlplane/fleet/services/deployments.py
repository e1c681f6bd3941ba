"""Deployments: how many replicas of each model are wanted (reconcile places or drains the rest),
within what bounds, and the one writer of that count. `actor` is the user acting (None: the
system); each change lands in the audit log."""

from datetime import datetime

from django.core.exceptions import ValidationError
from django.db import transaction
from django.forms.models import model_to_dict
from django.utils import timezone

from controlplane import live_events
from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, changes
from controlplane.catalog.models import AUTOSCALING_BOUNDS, Deployment
from controlplane.catalog.selectors import model_get_by_public_name, quality_refusal
from controlplane.common.services import validated_save
from controlplane.fleet import commands
from controlplane.fleet.models import LoadBackoff


def publish_deployment(deployment: Deployment, *, created: bool = False) -> None:
    """Tell the fleet pages a deployment changed (its desired count or limits, its backoffs, why it
    is unplaced): they show its status again; a new one joins the list."""
    live_events.publish(
        group=live_events.FLEET_GROUP,
        event="deployment.changed",
        data={
            "deployment_id": deployment.pk,
            "created": created,
        },
    )


# What a deployment edit may change, and what its audit entry compares.
DEPLOYMENT_FIELDS = ("desired_replicas", "min_replicas", "max_replicas", "keep_warm")
# More replicas of one model than any one fleet here runs; a typo (100 for 10) is refused.
MAX_REPLICAS_LIMIT = 256


# deployment_update's default for a setting the caller leaves as it is.
UNCHANGED = object()


def deployment_lock(deployment: Deployment) -> Deployment:
    """The deployment's row, locked until the transaction ends (with its model)."""
    return Deployment.objects.select_for_update().select_related("model").get(pk=deployment.pk)


def _check_whole_number(value, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError({field: f"Must be a whole number, not {value!r}."})


def _check_replica_count(value, field: str) -> None:
    _check_whole_number(value, field)
    if not 0 <= value <= MAX_REPLICAS_LIMIT:
        raise ValidationError({field: f"Must lie between 0 and {MAX_REPLICAS_LIMIT}; got {value}."})


@transaction.atomic
def deployment_create(
    *,
    model_name: str,
    desired_replicas: int = 1,
    min_replicas: int = 0,
    max_replicas: int = 1,
    keep_warm: bool = False,
    autoscale: bool = True,
    actor=None,
) -> Deployment:
    model = model_get_by_public_name(public_name=model_name)
    if model is None:
        raise ValidationError({"model": f"Unknown model {model_name!r}."})
    deployment = validated_save(
        Deployment(
            model=model,
            desired_replicas=desired_replicas,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            keep_warm=keep_warm,
            autoscale=autoscale,
            scaled_at=timezone.now(),
        )
    )
    audit_record(
        actor=actor,
        action=AuditEntry.Action.DEPLOYMENT_CREATE,
        target=deployment,
        target_label=model.public_name,
        detail=model_to_dict(deployment, fields=DEPLOYMENT_FIELDS),
    )
    publish_deployment(deployment, created=True)
    commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment


def _check_desired_in_bounds(deployment: Deployment, desired_replicas, *, field: str, refusal: str | None) -> None:
    """The one bounds check of a desired replica count: a whole number within the deployment's
    min_replicas..max_replicas, as the deployment has them now. `refusal` words the error for what
    the person did; by default, in the words of the limits form (Min, Max), naming the one to change."""
    _check_whole_number(desired_replicas, field)
    if not deployment.min_replicas <= desired_replicas <= deployment.max_replicas:
        fix = "raise Max replicas" if desired_replicas > deployment.max_replicas else "lower Min replicas"
        raise ValidationError(
            {
                field: refusal
                or (
                    f"This deployment allows {deployment.min_replicas} to {deployment.max_replicas} replicas; "
                    f"{fix} to scale to {desired_replicas}."
                )
            }
        )


def deployment_set_desired_replicas(
    *,
    deployment: Deployment,
    desired_replicas: int,
    now: datetime,
    field: str = "desired_replicas",
    refusal: str | None = None,
    save: bool = True,
) -> int:
    """The one writer of a deployment's desired replica count once it exists: an operator's scale or
    edit, a replica loaded or unloaded by hand, the autoscaler's decision and a cold start's wake
    all come here. Checks the count against the deployment's bounds (a ValidationError under
    `field`, worded by `refusal` if given; nothing changes), records `now` as the scaling time the
    autoscaler's cooldowns count from, and saves both; with `save=False` the caller saves them with
    the other fields it changes (an edit of the bounds, which the count is checked against and which
    must reach the row with it). The caller holds the row lock (`deployment_lock`) and audits,
    publishes and reconciles in its own words. Returns the count before."""
    _check_desired_in_bounds(deployment, desired_replicas, field=field, refusal=refusal)
    before = deployment.desired_replicas
    deployment.desired_replicas = desired_replicas
    deployment.scaled_at = now
    if save:
        deployment.save(update_fields=["desired_replicas", "scaled_at", "updated_at"])
    return before


@transaction.atomic
def deployment_scale(*, deployment: Deployment, desired_replicas: int, actor=None) -> Deployment:
    """Want `desired_replicas` replicas; reconcile places or drains the difference. More replicas
    than now are refused while the model misses the deployment's quality bar, saying why."""
    # Lock the row so two operators scaling at once cannot both pass validation on stale bounds.
    locked = deployment_lock(deployment)
    if desired_replicas > locked.desired_replicas:
        refusal = quality_refusal(deployment=locked)
        if refusal:
            raise ValidationError({"desired_replicas": refusal})
    return deployment_scale_locked(
        deployment=locked, desired_replicas=desired_replicas, actor=actor, now=timezone.now()
    )


def deployment_scale_locked(
    *, deployment: Deployment, desired_replicas: int, actor, now: datetime, detail: dict | None = None
) -> Deployment:
    """Scale a locked deployment on its own (an operator's scale, the autoscaler's decision, a cold
    start's wake): the new count, its audit entry, the pages told, reconcile asked."""
    before = deployment_set_desired_replicas(deployment=deployment, desired_replicas=desired_replicas, now=now)
    audit_record(
        actor=actor,
        action=AuditEntry.Action.DEPLOYMENT_SCALE,
        target=deployment,
        target_label=deployment.model.public_name,
        detail={"desired_replicas": [before, desired_replicas], **(detail or {})},
    )
    publish_deployment(deployment)
    commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment


def deployment_wake(*, model_id: int) -> bool:
    """Want at least one replica of this model, because a request is waiting for it (a cold start
    from zero). True when the deployment wants one now (it already did, or does from now on);
    False when it may not have any (no deployment, or max_replicas 0). Cheap when already awake:
    one read, no lock, no write; the gateway calls it at most every few seconds per model."""
    wants = Deployment.objects.filter(model_id=model_id).values_list("desired_replicas", "max_replicas").first()
    if wants is None or wants[1] < 1:
        return False
    if wants[0] >= 1:
        return True
    return _deployment_wake_locked(model_id=model_id)


@transaction.atomic
def _deployment_wake_locked(*, model_id: int) -> bool:
    deployment = Deployment.objects.select_for_update().select_related("model").filter(model_id=model_id).first()
    if deployment is None or deployment.max_replicas < 1:
        return False  # changed since the read above
    if deployment.desired_replicas >= 1:
        return True  # another gateway process woke it first
    deployment_scale_locked(
        deployment=deployment,
        desired_replicas=1,
        actor=None,
        now=timezone.now(),
        detail={"reason": "cold start: a request is waiting for a replica"},
    )
    return True


@transaction.atomic
def deployment_update(
    *,
    deployment: Deployment,
    desired_replicas: int,
    min_replicas: int,
    max_replicas: int,
    keep_warm: bool,
    autoscale: bool | None = None,
    target_concurrency: int | None = None,
    ttft_slo_ms: int | None = None,
    itl_slo_ms: int | None = None,
    idle_to_zero_seconds: int | None = None,
    max_perplexity_increase: float | None | object = UNCHANGED,
    actor=None,
) -> Deployment:
    """Set a deployment's replica counts, keep-warm and (each unless None) autoscaling settings at
    once, and its quality bar unless UNCHANGED (None clears it: deployment_set_quality_bound); each
    bad value is reported on its own field, and min <= desired <= max must hold afterwards."""
    if max_perplexity_increase is not UNCHANGED:
        deployment = deployment_set_quality_bound(
            deployment=deployment, max_perplexity_increase=max_perplexity_increase, actor=actor
        )
    deployment = deployment_lock(deployment)
    values = {"desired_replicas": desired_replicas, "min_replicas": min_replicas, "max_replicas": max_replicas}
    errors: dict[str, list[str]] = {}
    for field, value in values.items():
        try:
            _check_replica_count(value, field)
        except ValidationError as exc:
            errors.update(exc.message_dict)
    flags = {"keep_warm": keep_warm, **({"autoscale": autoscale} if autoscale is not None else {})}
    for field, value in flags.items():
        if not isinstance(value, bool):
            errors[field] = [f"Must be true or false, not {value!r}."]
    autoscaling = {
        field: value
        for field, value in {
            "target_concurrency": target_concurrency,
            "ttft_slo_ms": ttft_slo_ms,
            "itl_slo_ms": itl_slo_ms,
            "idle_to_zero_seconds": idle_to_zero_seconds,
        }.items()
        if value is not None
    }
    for field, value in autoscaling.items():
        low, high = AUTOSCALING_BOUNDS[field]
        if isinstance(value, bool) or not isinstance(value, int):
            errors[field] = [f"Must be a whole number, not {value!r}."]
        elif not low <= value <= high:
            errors[field] = [f"Must lie between {low:,} and {high:,}; got {value:,}."]
    if not errors and min_replicas > max_replicas:
        errors["min_replicas"] = [f"Min replicas ({min_replicas}) cannot exceed max replicas ({max_replicas})."]
    if errors:
        raise ValidationError(errors)
    compared = (*DEPLOYMENT_FIELDS, "autoscale", *AUTOSCALING_BOUNDS)
    before = model_to_dict(deployment, fields=compared)
    bounds = {"min_replicas": min_replicas, "max_replicas": max_replicas}
    for field, value in {**bounds, **flags, **autoscaling}.items():
        setattr(deployment, field, value)
    # The count within the new bounds; a new count is an operator's scale: the autoscaler's cooldowns restart.
    refusal = (
        f"Desired replicas must lie between min ({min_replicas}) and max ({max_replicas}); got {desired_replicas}."
    )
    if desired_replicas != deployment.desired_replicas:
        deployment_set_desired_replicas(
            deployment=deployment, desired_replicas=desired_replicas, now=timezone.now(), refusal=refusal, save=False
        )
    else:
        _check_desired_in_bounds(deployment, desired_replicas, field="desired_replicas", refusal=refusal)
    deployment.full_clean()
    diff = changes(before, model_to_dict(deployment, fields=compared))
    if not diff:
        return deployment
    deployment.save()
    audit_record(
        actor=actor,
        action=AuditEntry.Action.DEPLOYMENT_UPDATE,
        target=deployment,
        target_label=deployment.model.public_name,
        detail=diff,
    )
    publish_deployment(deployment)
    if "desired_replicas" in diff:
        commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment


@transaction.atomic
def deployment_retry_loads(*, deployment: Deployment, actor=None) -> Deployment:
    """Forget the deployment's load backoffs and reconcile now: every worker may be tried at once
    (after the operator fixed whatever made the loads fail)."""
    deployment = deployment_lock(deployment)
    backoffs = list(
        LoadBackoff.objects.select_for_update().select_related("worker").filter(deployment=deployment).order_by("pk")
    )
    if not backoffs:
        raise ValidationError({"deployment": f"{deployment.model.public_name} has no failed loads to retry."})
    LoadBackoff.objects.filter(pk__in=[b.pk for b in backoffs]).delete()
    audit_record(
        actor=actor,
        action=AuditEntry.Action.DEPLOYMENT_RETRY,
        target=deployment,
        target_label=deployment.model.public_name,
        detail={
            "backoffs": {b.worker.name: b.consecutive_failures for b in backoffs},
        },
    )
    publish_deployment(deployment)
    commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment


@transaction.atomic
def deployment_set_quality_bound(
    *, deployment: Deployment, max_perplexity_increase: float | None, actor=None
) -> Deployment:
    """Require the model's perplexity to be measured and at most `max_perplexity_increase` (a
    fraction: 0.02 is 2%) above its base model's before replicas are placed; None: no requirement.
    Replicas already running stay; reconcile places no new ones while the model misses the bar."""
    value = max_perplexity_increase
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 10:
            raise ValidationError({"max_perplexity_increase": f"Must be a fraction from 0 to 10, not {value!r}."})
        value = float(value)
    deployment = deployment_lock(deployment)
    before = deployment.max_perplexity_increase
    if before == value:
        return deployment
    deployment.max_perplexity_increase = value
    deployment.save(update_fields=["max_perplexity_increase", "updated_at"])
    audit_record(
        actor=actor,
        action=AuditEntry.Action.DEPLOYMENT_UPDATE,
        target=deployment,
        target_label=deployment.model.public_name,
        detail={"max_perplexity_increase": [before, value]},
    )
    publish_deployment(deployment)
    commands.request_reconcile(deployment_ids=[deployment.pk])
    return deployment
