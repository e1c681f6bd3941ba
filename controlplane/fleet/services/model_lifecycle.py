"""A catalog model's life as the fleet sees it: disabling one unloads its replicas (reconcile keeps
none of a disabled model's, through the ordinary unload path) and enabling it brings them back;
deleting one is allowed only while no replica of it runs and nothing billed names it."""

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import ProtectedError

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.billing.models import UsageRecord
from controlplane.catalog.models import Deployment, Model
from controlplane.catalog.services import model_set_enabled, model_snapshot
from controlplane.fleet import commands
from controlplane.fleet.models import Replica
from controlplane.fleet.services.deployments import publish_deployment


@transaction.atomic
def model_set_serving(*, model: Model, enabled: bool, actor=None) -> Model:
    """Enable or disable `model` (catalog.services.model_set_enabled) and have its deployment
    reconciled after commit: a disabled model's replicas drain and stop, an enabled one's desired
    replicas are placed again."""
    model = model_set_enabled(model=model, enabled=enabled, actor=actor)
    deployment = Deployment.objects.filter(model=model).first()
    if deployment is not None:
        commands.request_reconcile(deployment_ids=[deployment.pk])
        publish_deployment(deployment)
    return model


@transaction.atomic
def model_delete(*, model: Model, actor=None) -> None:
    """Remove `model` and its deployment from the catalog, with an audit entry holding what it was.
    Refused, saying what to do, while a replica of it is pending, loading, ready or draining, or
    while usage records, a request's credit hold or any other record names it (disable it instead)."""
    model = Model.objects.select_for_update().select_related("price_tier").get(pk=model.pk)
    deployment = Deployment.objects.select_for_update().filter(model=model).first()
    running = Replica.objects.filter(deployment=deployment, state__in=Replica.LIVE_STATES).count() if deployment else 0
    if running:
        action = "disable it and wait for them to stop" if model.enabled else "wait for them to stop"
        raise ValidationError(
            f"{model.public_name} still has {running} replica{'s' * (running != 1)} loaded or stopping: "
            f"{action}, then delete it."
        )
    used = UsageRecord.objects.filter(model=model).count()
    if used:
        raise ValidationError(
            f"{model.public_name} cannot be deleted: {used} usage record{'s' * (used != 1)} name it, and "
            f"billing history keeps its model. Disable it instead."
        )
    audit_record(actor=actor, action=AuditEntry.Action.MODEL_DELETE, target=model, detail=model_snapshot(model))
    if deployment is not None:
        deployment_id = deployment.pk
        deployment.delete()  # its stopped and failed replicas, backoffs and reports go with it
        # The fleet pages draw their deployment list again, without this one.
        publish_deployment(Deployment(pk=deployment_id), created=True)
    try:
        model.delete()
    except ProtectedError as exc:  # another record keeps its model (a request's credit hold...): all rolls back
        kinds = sorted({str(type(obj)._meta.verbose_name_plural) for obj in exc.protected_objects})
        raise ValidationError(
            f"{model.public_name} cannot be deleted: {', '.join(kinds)} name it. Disable it instead."
        ) from exc
