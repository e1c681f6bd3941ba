"""A model's life in the fleet: disabling it unloads its replicas through reconcile's ordinary
unload path and enabling it places them again; deleting it is allowed only while nothing runs or
is billed under it, and leaves an audit entry saying what it was."""

from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import Deployment, Model
from controlplane.fleet.commands import RECONCILE
from controlplane.fleet.models import Replica
from controlplane.fleet.reconcile import deployment_reconcile
from controlplane.fleet.services.model_lifecycle import model_delete, model_set_serving
from gpuworker.contract.tasks import LOAD_MODEL, UNLOAD_MODEL
from tests.controlplane.factories import (
    DeploymentFactory,
    GpuFactory,
    ModelFactory,
    ReplicaFactory,
    TenantFactory,
    UserFactory,
    usage_record_settled,
)
from tests.controlplane.fleet.conftest import make_worker, queued_tasks

pytestmark = pytest.mark.django_db
GB = 1024**3
# Where the control plane's own tasks wait (Celery's default queue).
CONTROL_PLANE_QUEUE = "celery"


def _reconcile(deployment):
    return deployment_reconcile(deployment_id=deployment.pk, now=timezone.now())


def test_disabling_unloads_the_replicas_and_enabling_brings_them_back(django_capture_on_commit_callbacks):
    worker = GpuFactory(worker=make_worker(), index=0, memory_total_bytes=80 * GB).worker
    deployment = DeploymentFactory(model=ModelFactory(gpu_memory_bytes=GB), desired_replicas=1, min_replicas=1)
    with django_capture_on_commit_callbacks(execute=True):
        [placed] = _reconcile(deployment).placed
    assert [name for name, _ in queued_tasks(worker.queue_name)] == [LOAD_MODEL]
    Replica.objects.filter(pk=placed).update(state=Replica.State.READY)

    with django_capture_on_commit_callbacks(execute=True):
        model_set_serving(model=deployment.model, enabled=False)
        outcome = _reconcile(deployment)
    assert outcome.removed == [placed]
    assert Replica.objects.get(pk=placed).state == Replica.State.DRAINING
    [(name, kwargs)] = queued_tasks(worker.queue_name)
    assert (name, kwargs["replica_id"]) == (UNLOAD_MODEL, placed)
    # The desired count is kept, and nothing is placed while the model is disabled.
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 1 and _reconcile(deployment).placed == []

    with django_capture_on_commit_callbacks(execute=True):
        model_set_serving(model=deployment.model, enabled=True)
        assert len(_reconcile(deployment).placed) == 1
    assert [name for name, _ in queued_tasks(worker.queue_name)] == [LOAD_MODEL]
    assert list(AuditEntry.objects.order_by("pk").values_list("action", flat=True)) == [
        "model.disable",
        "model.enable",
    ]


def test_a_disabled_models_replica_cannot_be_loaded_by_hand():
    from controlplane.fleet.services.replicas import replica_load_on

    worker = make_worker(device="cpu", cpu_memory_total_bytes=8 * GB)
    deployment = DeploymentFactory(model=ModelFactory(public_name="off", enabled=False, gpu_memory_bytes=GB))
    with pytest.raises(ValidationError, match="off is disabled: enable it in the catalog first"):
        replica_load_on(deployment=deployment, worker=worker, gpu=None)
    assert not Replica.objects.filter(deployment=deployment).exists()


def test_disabling_asks_for_a_reconcile_of_its_deployment(django_capture_on_commit_callbacks):
    deployment = DeploymentFactory()
    queued_tasks(CONTROL_PLANE_QUEUE)  # whatever an earlier test left
    with django_capture_on_commit_callbacks(execute=True):
        model_set_serving(model=deployment.model, enabled=False)
    assert queued_tasks(CONTROL_PLANE_QUEUE) == [(RECONCILE, {"deployment_ids": [deployment.pk]})]


def test_a_model_without_replicas_is_deleted_with_an_audit_entry():
    operator = UserFactory(role="operator", tenant=None)
    deployment = DeploymentFactory(model=ModelFactory(public_name="mistake"), desired_replicas=0)
    stopped = ReplicaFactory(deployment=deployment, worker=make_worker(), state=Replica.State.STOPPED)
    model_delete(model=deployment.model, actor=operator)
    assert not Model.objects.filter(public_name="mistake").exists()
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    assert not Replica.objects.filter(pk=stopped.pk).exists()
    entry = AuditEntry.objects.get(action=AuditEntry.Action.MODEL_DELETE)
    assert entry.actor == operator and entry.target_label == "mistake"
    assert entry.detail["public_name"] == "mistake" and entry.detail["weights_path"] == deployment.model.weights_path


@pytest.mark.parametrize("state", [Replica.State.PENDING, Replica.State.READY, Replica.State.DRAINING])
def test_delete_is_refused_while_a_replica_runs(state):
    deployment = DeploymentFactory(model=ModelFactory(public_name="busy"))
    ReplicaFactory(deployment=deployment, worker=make_worker(), state=state)
    with pytest.raises(ValidationError, match="busy still has 1 replica loaded or stopping: disable it"):
        model_delete(model=deployment.model)
    assert Model.objects.filter(public_name="busy").exists()
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.MODEL_DELETE).exists()


def test_delete_is_refused_for_a_model_with_billing_history():
    from controlplane.billing.services import credit_grant

    model = ModelFactory(public_name="used")
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("10"))
    usage_record_settled(tenant=tenant, model=model)
    with pytest.raises(ValidationError, match="1 usage record .*Disable it instead"):
        model_delete(model=model)
    assert Model.objects.filter(pk=model.pk).exists()


def test_delete_is_refused_while_a_request_holds_credit_for_it():
    from datetime import timedelta

    from controlplane.billing.holds import HoldRequest, credit_holds_place
    from controlplane.billing.models import CreditHold
    from controlplane.billing.services import credit_grant

    deployment = DeploymentFactory(model=ModelFactory(public_name="in-flight"), desired_replicas=0)
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("10"))
    (hold,) = credit_holds_place(
        requests=[HoldRequest("req-in-flight", tenant.pk, deployment.model.pk, None, 1)],
        at=timezone.now(),
        expires_at=timezone.now() + timedelta(minutes=10),
    )
    assert isinstance(hold, CreditHold)
    with pytest.raises(ValidationError, match="in-flight cannot be deleted: credit holds name it"):
        model_delete(model=deployment.model)
    # Nothing went: the deployment deleted before the refusal is rolled back with it.
    assert Deployment.objects.filter(pk=deployment.pk).exists()
    assert Model.objects.filter(pk=deployment.model.pk).exists()
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.MODEL_DELETE).exists()


def test_a_model_never_deployed_is_deleted():
    model = ModelFactory(public_name="fresh", price_tier__price_per_request=Decimal("0.01"))
    model_delete(model=model)
    assert not Model.objects.filter(pk=model.pk).exists()
