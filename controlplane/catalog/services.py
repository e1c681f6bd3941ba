"""Writes for the catalog: adding models and deploying/scaling them. Atomic and fully validated;
a change to a deployment asks the fleet to reconcile it once committed."""

from django.core.exceptions import ValidationError
from django.db import transaction

from controlplane.catalog.models import Deployment, Model
from controlplane.catalog.selectors import model_get_by_public_name
from controlplane.fleet.commands import request_reconcile

# Bytes per parameter of bf16/fp16 weights, and the share added for activations and a KV cache
# large enough to batch; an operator can always enter a measured figure instead.
_BYTES_PER_PARAMETER = 2
_RUNTIME_OVERHEAD = 1.2


def estimate_gpu_memory_bytes(*, parameter_count: int) -> int:
    return int(parameter_count * _BYTES_PER_PARAMETER * _RUNTIME_OVERHEAD)


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
) -> Model:
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
    model.save()
    return model


@transaction.atomic
def model_set_enabled(*, model: Model, enabled: bool) -> Model:
    model.enabled = enabled
    model.save(update_fields=["enabled", "updated_at"])
    return model


@transaction.atomic
def deployment_create(
    *,
    model_name: str,
    desired_replicas: int = 1,
    min_replicas: int = 0,
    max_replicas: int = 1,
    keep_warm: bool = False,
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
    request_reconcile(deployment_ids=[deployment.pk])
    return deployment


@transaction.atomic
def deployment_scale(*, deployment: Deployment, desired_replicas: int, actor=None) -> Deployment:
    """Want `desired_replicas` replicas; reconcile places or drains the difference. `actor` is the
    user acting, for the audit log of a later issue."""
    # Lock the row so two operators scaling at once cannot both pass validation on stale bounds.
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    if isinstance(desired_replicas, bool) or not isinstance(desired_replicas, int):
        raise ValidationError({"desired_replicas": f"Must be a whole number, not {desired_replicas!r}."})
    if not deployment.min_replicas <= desired_replicas <= deployment.max_replicas:
        raise ValidationError({"desired_replicas": (
            f"Must lie between min_replicas ({deployment.min_replicas}) and max_replicas "
            f"({deployment.max_replicas}); got {desired_replicas}."
        )})
    deployment.desired_replicas = desired_replicas
    deployment.full_clean()
    deployment.save(update_fields=["desired_replicas", "updated_at"])
    request_reconcile(deployment_ids=[deployment.pk])
    return deployment
