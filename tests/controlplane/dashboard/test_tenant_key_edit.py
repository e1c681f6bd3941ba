"""Editing a key after its creation: name, models and limits change, the secret does not, every
edit is audited and reaches the gateways' key caches; another tenant's key is not found."""

import re
from decimal import Decimal

import pytest
from django.urls import reverse

from controlplane.accounts.models import ApiKey, ApiKeyChange, User
from controlplane.accounts.selectors import api_key_authenticate
from controlplane.accounts.services import api_key_revoke, playground_key_create
from controlplane.audit.models import AuditEntry
from tests.controlplane.factories import ApiKeyFactory, ModelFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def member(client):
    user = UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory(name="Acme"))
    client.force_login(user)
    return user


def _edit(client, api_key, **data):
    fields = {"name": api_key.name, **data}
    return client.post(reverse("dashboard:key_edit", args=[api_key.pk]), fields)


def test_the_edit_page_shows_the_keys_settings(client, member):
    model = ModelFactory(public_name="chat-small")
    api_key = ApiKeyFactory(tenant=member.tenant, name="ci", all_models=False, rate_limit_per_minute=30)
    api_key.allowed_models.set([model])
    page = client.get(reverse("dashboard:key_edit", args=[api_key.pk])).content.decode()
    assert 'value="ci"' in page and 'value="30"' in page and api_key.prefix in page
    box = re.search(r'<input type="checkbox" name="allowed_models" value="chat-small"[^>]*>', page).group(0)
    assert "checked" in box
    assert api_key.plaintext not in page
    keys_page = client.get(reverse("dashboard:keys")).content.decode()
    assert reverse("dashboard:key_edit", args=[api_key.pk]) in keys_page


def test_an_edit_changes_name_models_and_limits_and_keeps_the_secret(client, member):
    small, large = ModelFactory(public_name="chat-small"), ModelFactory(public_name="chat-large")
    api_key = ApiKeyFactory(tenant=member.tenant, name="ci")
    before = (api_key.key_hash, api_key.prefix)
    response = _edit(
        client,
        api_key,
        name="ci-runner",
        allowed_models=["chat-small"],
        rate_limit_per_minute="20",
        max_concurrent_requests="2",
        monthly_spend_limit="7.50",
    )
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:keys")
    api_key.refresh_from_db()
    assert (api_key.key_hash, api_key.prefix) == before
    assert api_key.name == "ci-runner" and not api_key.all_models
    assert list(api_key.allowed_models.all()) == [small] and large not in api_key.allowed_models.all()
    assert (api_key.rate_limit_per_minute, api_key.max_concurrent_requests) == (20, 2)
    assert api_key.monthly_spend_limit == Decimal("7.50")
    # The same plaintext still authenticates, now with the new settings.
    assert api_key_authenticate(plaintext=api_key.plaintext).name == "ci-runner"
    entry = AuditEntry.objects.get(action=AuditEntry.Action.API_KEY_UPDATE)
    assert entry.actor == member and entry.target_id == str(api_key.pk)
    assert entry.detail["name"] == ["ci", "ci-runner"] and entry.detail["models"] == ["all", "chat-small"]
    assert entry.detail["rate_limit_per_minute"] == [None, 20]
    assert entry.detail["monthly_spend_limit"] == ["none", "$7.50"]
    # The gateways' key caches are told.
    assert ApiKeyChange.objects.filter(key_hash=api_key.key_hash).exists()
    assert "ci-runner" in client.get(reverse("dashboard:keys")).content.decode()


def test_back_to_all_models_and_no_limits(client, member):
    model = ModelFactory(public_name="chat-small")
    api_key = ApiKeyFactory(tenant=member.tenant, name="ci", all_models=False, rate_limit_per_minute=5)
    api_key.allowed_models.set([model])
    _edit(client, api_key)
    api_key.refresh_from_db()
    assert api_key.all_models and not api_key.allowed_models.exists() and api_key.rate_limit_per_minute is None
    assert AuditEntry.objects.get(action=AuditEntry.Action.API_KEY_UPDATE).detail["models"] == ["chat-small", "all"]


def test_saving_without_a_change_writes_no_audit_entry(client, member):
    api_key = ApiKeyFactory(tenant=member.tenant, name="ci")
    assert _edit(client, api_key).status_code == 302
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.API_KEY_UPDATE).exists()


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"name": "taken"}, "name", "already has a key with this name"),
        ({"name": "  "}, "name", "required"),
        ({"rate_limit_per_minute": "0"}, "rate_limit_per_minute", "greater than or equal to 1"),
        ({"monthly_spend_limit": "-1"}, "monthly_spend_limit", "greater than or equal to 0"),
        ({"allowed_models": ["no-such-model"]}, "allowed_models", "Select a valid choice"),
    ],
)
def test_bad_input_is_refused_beside_its_field_and_nothing_changes(client, member, data, field, message):
    ApiKeyFactory(tenant=member.tenant, name="taken")
    api_key = ApiKeyFactory(tenant=member.tenant, name="ci")
    response = _edit(client, api_key, **data)
    assert response.status_code == 200
    page = response.content.decode()
    start = page.index(f'id="error-{field}"')
    assert message in page[start : page.index("</div>", start)]
    api_key.refresh_from_db()
    assert api_key.name == "ci" and api_key.rate_limit_per_minute is None and api_key.all_models
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.API_KEY_UPDATE).exists()


def test_a_revoked_key_cannot_be_edited(client, member):
    api_key = api_key_revoke(api_key=ApiKeyFactory(tenant=member.tenant, name="old"))
    response = _edit(client, api_key, name="new")
    assert response.status_code == 200 and "A revoked key cannot be edited." in response.content.decode()
    api_key.refresh_from_db()
    assert api_key.name == "old"


def test_another_tenants_key_is_not_found(client, member):
    other = ApiKeyFactory(tenant=TenantFactory(), name="theirs")
    assert client.get(reverse("dashboard:key_edit", args=[other.pk])).status_code == 404
    assert _edit(client, other, name="mine now").status_code == 404
    other.refresh_from_db()
    assert other.name == "theirs" and not AuditEntry.objects.exists()


def test_a_playground_session_key_is_not_found(client, member):
    session = playground_key_create(user=member).api_key
    assert _edit(client, session, name="kept").status_code == 404


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
def test_members_without_a_tenant_role_are_forbidden(client, role):
    api_key = ApiKeyFactory(name="ci")
    client.force_login(UserFactory(role=role, tenant=None))
    assert client.get(reverse("dashboard:key_edit", args=[api_key.pk])).status_code == 403
    assert _edit(client, api_key, name="taken over").status_code == 403
    api_key.refresh_from_db()
    assert api_key.name == "ci"


def test_a_disabled_model_stays_ticked_so_saving_keeps_it(client, member):
    model = ModelFactory(public_name="retired", enabled=False)
    api_key = ApiKeyFactory(tenant=member.tenant, name="ci", all_models=False)
    api_key.allowed_models.set([model])
    assert _edit(client, api_key, allowed_models=["retired"], rate_limit_per_minute="9").status_code == 302
    api_key.refresh_from_db()
    assert list(api_key.allowed_models.all()) == [model] and api_key.rate_limit_per_minute == 9
    assert ApiKey.objects.count() == 1


def test_a_key_moves_to_the_batch_class_and_back_audited_and_the_gateways_told(client, member):
    api_key = ApiKeyFactory(tenant=member.tenant, name="nightly")
    page = client.get(reverse("dashboard:key_edit", args=[api_key.pk])).content.decode()
    assert 'name="batch_priority"' in page
    assert _edit(client, api_key, batch_priority="on").status_code == 302
    api_key.refresh_from_db()
    assert api_key.batch_priority
    assert AuditEntry.objects.get(action=AuditEntry.Action.API_KEY_UPDATE).detail["batch_priority"] == [False, True]
    assert ApiKeyChange.objects.filter(key_hash=api_key.key_hash).exists()
    page = client.get(reverse("dashboard:key_edit", args=[api_key.pk])).content.decode()
    box = re.search(r'<input type="checkbox" name="batch_priority"[^>]*>', page).group(0)
    assert "checked" in box  # shown as it is, so the form posts it back unchanged
    assert _edit(client, api_key).status_code == 302  # the box left unticked: back to interactive
    api_key.refresh_from_db()
    assert not api_key.batch_priority
