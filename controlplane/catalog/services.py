"""Writes for the catalog: adding and editing models, deploying and scaling them. Atomic and fully
validated; every change lands in the audit log (`actor`: the user acting, None for the system), and
a change to a deployment asks the fleet to reconcile it once committed."""

from collections.abc import Iterable

from django.core.exceptions import ValidationError
from django.db import transaction
from django.forms.models import model_to_dict

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, changes
from controlplane.catalog.models import Deployment, Model
from controlplane.catalog.selectors import model_get_by_public_name
from controlplane.fleet.commands import request_reconcile
from controlplane.fleet.selectors import weights_path_reports

# What a model edit may change, and what its audit entry compares.
MODEL_FIELDS = ("public_name", "family", "kind", "weights_path", "context_length", "parameter_count",
                "gpu_memory_bytes", "price_tier", "enabled")
DEPLOYMENT_FIELDS = ("desired_replicas", "min_replicas", "max_replicas", "keep_warm")

# Bytes per parameter of bf16/fp16 weights, and the share added for activations and a KV cache
# large enough to batch; an operator can always enter a measured figure instead.
_BYTES_PER_PARAMETER = 2
_RUNTIME_OVERHEAD = 1.2


def estimate_gpu_memory_bytes(*, parameter_count: int) -> int:
    return int(parameter_count * _BYTES_PER_PARAMETER * _RUNTIME_OVERHEAD)


def _check_weights_path(weights_path: str, verify_on: Iterable | None) -> None:
    """Refuse a path that a chosen worker searches and did not find; workers that cannot tell
    (no roots, or the path outside them) do not block it."""
    if verify_on is None or not weights_path:
        return
    missing = [r.message for r in weights_path_reports(weights_path=weights_path, workers=verify_on)
               if r.status == "missing"]
    if missing:
        raise ValidationError({"weights_path": missing})


def _model_snapshot(model: Model) -> dict:
    values = model_to_dict(model, fields=MODEL_FIELDS)
    values["price_tier"] = str(model.price_tier) if model.price_tier_id else None
    return values


@transaction.atomic
def model_create(
    *,
    public_name: str,
    family: str,
    kind: str,
    weights_path: str,
    context_length: int,
    parameter_count: int,
    price_tier,
    gpu_memory_bytes: int | None = None,
    enabled: bool = True,
    actor=None,
    verify_on: Iterable | None = None,
) -> Model:
    """Add a model. `verify_on`: workers whose reported checkpoints the weight path must be among
    (where they can tell); None checks nothing."""
    if gpu_memory_bytes is None and isinstance(parameter_count, int) and parameter_count > 0:
        gpu_memory_bytes = estimate_gpu_memory_bytes(parameter_count=parameter_count)
    model = Model(
        public_name=public_name,
        family=family,
        kind=kind,
        weights_path=weights_path,
        context_length=context_length,
        parameter_count=parameter_count,
        gpu_memory_bytes=gpu_memory_bytes,
        price_tier=price_tier,
        enabled=enabled,
    )
    model.full_clean()
    _check_weights_path(model.weights_path, verify_on)
    model.save()
    audit_record(actor=actor, action=AuditEntry.Action.MODEL_CREATE, target=model, detail=_model_snapshot(model))
    return model


@transaction.atomic
def model_update(*, model: Model, actor=None, verify_on: Iterable | None = None, **fields) -> Model:
    """Change any of MODEL_FIELDS. A new weight path is checked like model_create's; changing
    the weights (or the model's memory) makes reconcile retry workers where it failed before."""
    unknown = set(fields) - set(MODEL_FIELDS)
    if unknown:
        raise TypeError(f"model_update cannot change {', '.join(sorted(unknown))}")
    model = Model.objects.select_for_update().select_related("price_tier").get(pk=model.pk)
    before = _model_snapshot(model)
    for name, value in fields.items():
        setattr(model, name, value)
    model.full_clean()
    if model.weights_path != before["weights_path"]:
        _check_weights_path(model.weights_path, verify_on)
    after = _model_snapshot(model)
    diff = changes(before, after)
    if not diff:
        return model
    model.save()
    audit_record(actor=actor, action=AuditEntry.Action.MODEL_UPDATE, target=model, detail=diff)
    return model


@transaction.atomic
def model_set_enabled(*, model: Model, enabled: bool, actor=None) -> Model:
    model = Model.objects.select_for_update().get(pk=model.pk)
    if model.enabled == enabled:
        return model  # nothing changed, nothing to record
    model.enabled = enabled
    model.save(update_fields=["enabled", "updated_at"])
    action = AuditEntry.Action.MODEL_ENABLE if enabled else AuditEntry.Action.MODEL_DISABLE
    audit_record(actor=actor, action=action, target=model, detail={"enabled": [not enabled, enabled]})
    return model


@transaction.atomic
def deployment_create(
    *,
    model_name: str,
    desired_replicas: int = 1,
    min_replicas: int = 0,
    max_replicas: int = 1,
    keep_warm: bool = False,
    actor=None,
) -> Deployment:
    model = model_get_by_public_name(public_name=model_name)
    if model is None:
        raise ValidationError({"model": f"Unknown model {model_name!r}."})
    deployment = Deployment(
        model=model,
        desired_replicas=desired_replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        keep_warm=keep_warm,
    )
    deployment.full_clean()
    deployment.save()
    audit_record(actor=actor, action=AuditEntry.Action.DEPLOYMENT_CREATE, target=deployment,
                 target_label=model.public_name, detail=model_to_dict(deployment, fields=DEPLOYMENT_FIELDS))
    request_reconcile(deployment_ids=[deployment.pk])
    return deployment


@transaction.atomic
def deployment_scale(*, deployment: Deployment, desired_replicas: int, actor=None) -> Deployment:
    """Want `desired_replicas` replicas; reconcile places or drains the difference."""
    # Lock the row so two operators scaling at once cannot both pass validation on stale bounds.
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    if isinstance(desired_replicas, bool) or not isinstance(desired_replicas, int):
        raise ValidationError({"desired_replicas": f"Must be a whole number, not {desired_replicas!r}."})
    if not deployment.min_replicas <= desired_replicas <= deployment.max_replicas:
        raise ValidationError({"desired_replicas": (
            f"Must lie between min_replicas ({deployment.min_replicas}) and max_replicas "
            f"({deployment.max_replicas}); got {desired_replicas}."
        )})
    before = deployment.desired_replicas
    deployment.desired_replicas = desired_replicas
    deployment.full_clean()
    deployment.save(update_fields=["desired_replicas", "updated_at"])
    audit_record(actor=actor, action=AuditEntry.Action.DEPLOYMENT_SCALE, target=deployment,
                 target_label=deployment.model.public_name, detail={"desired_replicas": [before, desired_replicas]})
    request_reconcile(deployment_ids=[deployment.pk])
    return deployment


def _whole(value, field: str, *, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError({field: f"Must be a whole number, not {value!r}."})
    if not 0 <= value <= maximum:
        raise ValidationError({field: f"Must lie between 0 and {maximum}; got {value}."})


# More replicas of one model than any one fleet here runs; a typo (100 for 10) is refused.
MAX_REPLICAS_LIMIT = 256


@transaction.atomic
def deployment_update(
    *, deployment: Deployment, desired_replicas: int, min_replicas: int, max_replicas: int, keep_warm: bool,
    actor=None,
) -> Deployment:
    """Set a deployment's replica counts and keep-warm at once; each bad value is reported on its
    own field, and min <= desired <= max must hold afterwards."""
    deployment = Deployment.objects.select_for_update().select_related("model").get(pk=deployment.pk)
    values = {"desired_replicas": desired_replicas, "min_replicas": min_replicas, "max_replicas": max_replicas}
    errors: dict[str, list[str]] = {}
    for field, value in values.items():
        try:
            _whole(value, field, maximum=MAX_REPLICAS_LIMIT)
        except ValidationError as exc:
            errors.update(exc.message_dict)
    if not isinstance(keep_warm, bool):
        errors["keep_warm"] = [f"Must be true or false, not {keep_warm!r}."]
    if not errors:
        if min_replicas > max_replicas:
            errors["min_replicas"] = [f"Min replicas ({min_replicas}) cannot exceed max replicas ({max_replicas})."]
        elif not min_replicas <= desired_replicas <= max_replicas:
            errors["desired_replicas"] = [f"Desired replicas must lie between min ({min_replicas}) and max "
                                          f"({max_replicas}); got {desired_replicas}."]
    if errors:
        raise ValidationError(errors)
    before = model_to_dict(deployment, fields=DEPLOYMENT_FIELDS)
    for field, value in {**values, "keep_warm": keep_warm}.items():
        setattr(deployment, field, value)
    deployment.full_clean()
    diff = changes(before, model_to_dict(deployment, fields=DEPLOYMENT_FIELDS))
    if not diff:
        return deployment
    deployment.save()
    audit_record(actor=actor, action=AuditEntry.Action.DEPLOYMENT_UPDATE, target=deployment,
                 target_label=deployment.model.public_name, detail=diff)
    if "desired_replicas" in diff:
        request_reconcile(deployment_ids=[deployment.pk])
    return deployment
