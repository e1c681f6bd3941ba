from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.accounts.selectors import ApiKeyRejected, api_key_allows_model, api_key_authenticate, tenant_names
from controlplane.accounts.services import api_key_create, api_key_revoke
from tests.controlplane.factories import ApiKeyFactory, ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db


def test_authenticate_finds_the_key_by_its_hash():
    result = api_key_create(tenant=TenantFactory(), name="k")
    assert api_key_authenticate(plaintext=result.plaintext) == result.api_key


@pytest.mark.parametrize("presented", ["", "sk-", "sk-not-a-real-key", "Bearer sk-x", "pk-abc"])
def test_authenticate_rejects_unknown_keys(presented):
    ApiKeyFactory()
    with pytest.raises(ApiKeyRejected, match="Invalid API key"):
        api_key_authenticate(plaintext=presented)


def test_authenticate_rejects_a_key_differing_in_one_character():
    key = ApiKeyFactory()
    last = key.plaintext[-1]
    altered = key.plaintext[:-1] + ("A" if last != "A" else "B")
    with pytest.raises(ApiKeyRejected):
        api_key_authenticate(plaintext=altered)


def test_authenticate_rejects_revoked_keys():
    result = api_key_create(tenant=TenantFactory(), name="k")
    api_key_revoke(api_key=result.api_key)
    with pytest.raises(ApiKeyRejected, match="revoked"):
        api_key_authenticate(plaintext=result.plaintext)


def test_authenticate_rejects_expired_keys():
    now = timezone.now()
    key = ApiKeyFactory(expires_at=now + timedelta(minutes=5))
    assert api_key_authenticate(plaintext=key.plaintext, now=now) == key
    with pytest.raises(ApiKeyRejected, match="expired"):
        api_key_authenticate(plaintext=key.plaintext, now=now + timedelta(minutes=5))


def test_authenticate_rejects_keys_of_deactivated_tenants():
    key = ApiKeyFactory(tenant=TenantFactory(is_active=False))
    with pytest.raises(ApiKeyRejected, match="deactivated"):
        api_key_authenticate(plaintext=key.plaintext)


def test_allows_model():
    allowed, other = ModelFactory(), ModelFactory()
    everything = ApiKeyFactory(all_models=True)
    limited = ApiKeyFactory(all_models=False)
    limited.allowed_models.set([allowed])
    assert api_key_allows_model(api_key=everything, model=other)
    assert api_key_allows_model(api_key=limited, model=allowed)
    assert not api_key_allows_model(api_key=limited, model=other)


def test_tenant_names_are_read_once_then_cached_until_the_tenant_changes(django_assert_num_queries):
    acme, other = TenantFactory(name="acme"), TenantFactory(name="other")
    missing = other.pk + 1000
    with django_assert_num_queries(1):
        assert tenant_names(tenant_ids=[acme.pk, str(other.pk), missing]) == {acme.pk: "acme", other.pk: "other"}
    with django_assert_num_queries(0):  # what a live page redrawn on every heartbeat costs
        assert tenant_names(tenant_ids=[acme.pk, other.pk]) == {acme.pk: "acme", other.pk: "other"}
        assert tenant_names(tenant_ids=[]) == {}
    acme.name = "acme & co"
    acme.save()
    with django_assert_num_queries(1):  # only the renamed tenant is read again
        assert tenant_names(tenant_ids=[acme.pk, other.pk]) == {acme.pk: "acme & co", other.pk: "other"}
    other_id = other.pk
    other.delete()
    assert tenant_names(tenant_ids=[acme.pk, other_id]) == {acme.pk: "acme & co"}
