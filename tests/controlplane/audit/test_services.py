"""The audit log: what audit_record stores, and that every operator action recorded through the
catalog and fleet services lands in it, whoever calls them (and nothing when they refuse)."""

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from controlplane.accounts.models import User
from controlplane.audit.models import AuditEntry
from controlplane.audit.selectors import audit_actor_labels, audit_entries
from controlplane.audit.services import SYSTEM_ACTOR, audit_record, audit_source, changes
from controlplane.catalog.services import model_create, model_set_enabled, model_update
from controlplane.fleet.models import Replica
from controlplane.fleet.services.deployments import deployment_create, deployment_scale, deployment_update
from controlplane.fleet.services.replicas import replica_load_on, replica_unload
from controlplane.fleet.services.workers import worker_drain
from tests.controlplane.dashboard.ops_support import _private_live_cache, make_worker  # noqa: F401
from tests.controlplane.factories import (
    DeploymentFactory,
    GpuFactory,
    ModelFactory,
    PriceTierFactory,
    ReplicaFactory,
    UserFactory,
)

pytestmark = pytest.mark.django_db


def test_an_entry_keeps_the_address_it_was_done_from():
    model = ModelFactory()
    outside = audit_record(actor=None, action=AuditEntry.Action.MODEL_UPDATE, target=model)
    with audit_source("2001:db8::5"):
        inside = audit_record(actor=None, action=AuditEntry.Action.MODEL_UPDATE, target=model)
    after = audit_record(actor=None, action=AuditEntry.Action.MODEL_UPDATE, target=model)
    assert [
        e.source_address for e in AuditEntry.objects.filter(pk__in=[outside.pk, inside.pk, after.pk]).order_by("pk")
    ] == [None, "2001:db8::5", None]


def test_a_dashboard_action_records_the_clients_address(client):
    user = UserFactory(role=User.Role.OPERATOR)
    client.force_login(user)
    model = ModelFactory(enabled=True)
    client.post(reverse("dashboard:catalog_set_enabled", args=[model.pk]), {"enabled": "0"}, REMOTE_ADDR="198.51.100.9")
    assert AuditEntry.objects.get(action=AuditEntry.Action.MODEL_DISABLE).source_address == "198.51.100.9"


def test_audit_record_keeps_who_what_and_the_target_as_it_was():
    user = UserFactory(role=User.Role.OPERATOR, username="olga")
    model = ModelFactory(public_name="llama-8b")
    entry = audit_record(
        actor=user, action=AuditEntry.Action.MODEL_UPDATE, target=model, detail={"context_length": [4096, 8192]}
    )
    entry.refresh_from_db()
    assert (entry.actor, entry.actor_label, entry.action) == (user, "olga", "model.update")
    assert (entry.target_type, entry.target_id, entry.target_label) == ("catalog.model", str(model.pk), "llama-8b")
    assert entry.describe() == "context_length: 4096 → 8192"
    user.delete()
    entry.refresh_from_db()
    assert (entry.actor, entry.actor_label) == (None, "olga")  # history outlives the account


def test_no_person_is_recorded_as_the_system():
    entry = audit_record(actor=None, action=AuditEntry.Action.MODEL_CREATE, target=ModelFactory())
    assert (entry.actor, entry.actor_label) == (None, SYSTEM_ACTOR)


def test_audit_record_refuses_unknown_actions_and_unsaved_targets():
    with pytest.raises(ValueError, match="Unknown audit action"):
        audit_record(actor=None, action="model.explode", target=ModelFactory())
    with pytest.raises(ValueError, match="no primary key"):
        audit_record(actor=None, action=AuditEntry.Action.MODEL_CREATE, target=ModelFactory.build())


def test_changes_lists_only_what_differs():
    assert changes({"a": 1, "b": 2}, {"a": 1, "b": 3}) == {"b": [2, 3]}


def test_selectors_filter_by_action_and_actor_newest_first():
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    model = ModelFactory()
    first = audit_record(actor=alice, action=AuditEntry.Action.MODEL_DISABLE, target=model)
    second = audit_record(actor=bob, action=AuditEntry.Action.MODEL_ENABLE, target=model)
    third = audit_record(actor=alice, action=AuditEntry.Action.MODEL_ENABLE, target=model)
    assert list(audit_entries()) == [third, second, first]
    assert list(audit_entries(actor="alice")) == [third, first]
    assert list(audit_entries(action="model.enable", actor="alice")) == [third]
    assert audit_actor_labels() == ["alice", "bob"]


def _model_fields(**overrides):
    return {
        "public_name": "qwen-7b",
        "family": "qwen2",
        "kind": "chat",
        "weights_path": "/models/qwen-7b",
        "context_length": 8192,
        "parameter_count": 7_000_000_000,
        "price_tier": PriceTierFactory(),
        **overrides,
    }


def test_catalog_services_audit_each_change_with_its_actor():
    olga = UserFactory(role=User.Role.OPERATOR, username="olga")
    model = model_create(actor=olga, **_model_fields())
    model_update(model=model, actor=olga, context_length=16384)
    model_update(model=model, actor=olga, context_length=16384)  # no change, no entry
    model_set_enabled(model=model, enabled=False, actor=olga)
    deployment = deployment_create(model_name="qwen-7b", desired_replicas=0, max_replicas=2, actor=olga)
    deployment_scale(deployment=deployment, desired_replicas=2, actor=olga)
    deployment_update(
        deployment=deployment, desired_replicas=2, min_replicas=1, max_replicas=4, keep_warm=True, actor=olga
    )
    entries = list(audit_entries().order_by("pk"))
    assert [e.action for e in entries] == [
        "model.create",
        "model.update",
        "model.disable",
        "deployment.create",
        "deployment.scale",
        "deployment.update",
    ]
    assert {e.actor_label for e in entries} == {"olga"}
    assert entries[1].detail == {"context_length": [8192, 16384]}
    assert entries[4].detail == {"desired_replicas": [0, 2]}
    assert entries[5].detail == {"min_replicas": [0, 1], "max_replicas": [2, 4], "keep_warm": [False, True]}


def test_a_refused_change_leaves_no_entry():
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=2)
    with pytest.raises(ValidationError):
        deployment_scale(deployment=deployment, desired_replicas=5, actor=None)
    with pytest.raises(ValidationError) as refused:
        deployment_update(deployment=deployment, desired_replicas=1, min_replicas=3, max_replicas=2, keep_warm=False)
    assert refused.value.message_dict == {"min_replicas": ["Min replicas (3) cannot exceed max replicas (2)."]}
    assert not AuditEntry.objects.exists()


def test_fleet_actions_are_audited():
    olga = UserFactory(role=User.Role.OPERATOR, username="olga")
    gpu = GpuFactory(worker=make_worker(), index=0)
    deployment = DeploymentFactory(desired_replicas=0, max_replicas=2)
    replica = replica_load_on(deployment=deployment, worker=gpu.worker, gpu=gpu, actor=olga)
    replica_unload(replica=replica, actor=olga)
    other = make_worker()
    ReplicaFactory(worker=other, state=Replica.State.READY, endpoint_url="http://127.0.0.1:9000")
    worker_drain(worker=other, actor=olga)
    load, unload, drain = audit_entries().order_by("pk")
    assert (load.action, load.target_type, load.target_id) == ("replica.load", "fleet.replica", str(replica.pk))
    assert load.detail == {
        "model": deployment.model.public_name,
        "worker": gpu.worker.name,
        "gpu_index": 0,
        "desired_replicas": [0, 1],
    }
    assert (unload.action, unload.detail["state"]) == ("replica.unload", ["pending", "stopped"])
    assert (drain.action, drain.target_label) == ("worker.drain", other.name)
    assert load.target_label == f"{deployment.model.public_name} replica {replica.pk} on {gpu.worker.name}"
    assert drain.detail["state"] == ["online", "draining"]


def test_key_creation_and_revocation_are_audited_but_playground_keys_are_not():
    from controlplane.accounts.services import api_key_create, api_key_revoke, playground_key_create
    from tests.controlplane.factories import TenantFactory

    member = UserFactory(username="alice", tenant=TenantFactory(name="Acme"))
    created = api_key_create(tenant=member.tenant, name="ci", rate_limit_per_minute=30, created_by=member)
    api_key_revoke(api_key=created.api_key, actor=member)
    session = playground_key_create(user=member)
    api_key_revoke(api_key=session.api_key, actor=member)
    entries = list(AuditEntry.objects.order_by("pk"))
    assert [(e.action, e.actor_label) for e in entries] == [("api_key.create", "alice"), ("api_key.revoke", "alice")]
    assert entries[0].target_label == f"Acme: ci ({created.api_key.prefix}…)"
    assert entries[0].detail == {"models": "all", "rate_limit_per_minute": 30}
    assert created.plaintext not in str(entries[0].detail) + entries[0].target_label


def test_tenant_creation_is_audited():
    from controlplane.accounts.services import tenant_create

    admin = UserFactory(username="root", role=User.Role.ADMIN, tenant=None)
    tenant = tenant_create(name="Initech", actor=admin)
    entry = AuditEntry.objects.get(action=AuditEntry.Action.TENANT_CREATE)
    assert (entry.actor, entry.target_id, entry.target_label) == (admin, str(tenant.pk), "Initech")


def test_a_keys_spend_limit_is_audited_with_its_change():
    from decimal import Decimal

    from controlplane.accounts.services import api_key_create, api_key_set_spend_limit
    from tests.controlplane.factories import TenantFactory

    member = UserFactory(username="alice", tenant=TenantFactory(name="Acme"))
    api_key = api_key_create(
        tenant=member.tenant, name="ci", monthly_spend_limit=Decimal("5"), created_by=member
    ).api_key
    api_key_set_spend_limit(api_key=api_key, monthly_spend_limit=Decimal("12.5"), actor=member)
    api_key_set_spend_limit(api_key=api_key, monthly_spend_limit=None, actor=member)
    created, raised, cleared = AuditEntry.objects.order_by("pk")
    assert created.detail == {"models": "all", "monthly_spend_limit": "$5.00"}
    assert (raised.action, raised.actor_label, raised.describe()) == (
        "api_key.spend_limit",
        "alice",
        "monthly_spend_limit: $5.00 → $12.50",
    )
    assert cleared.describe() == "monthly_spend_limit: $12.50 → none"
