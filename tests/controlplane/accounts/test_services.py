from datetime import timedelta
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.accounts.keys import hash_api_key
from controlplane.accounts.models import ApiKey, Tenant, User
from controlplane.accounts.services import (
    api_key_create,
    api_key_revoke,
    api_key_set_spend_limit,
    tenant_create,
    user_create,
    user_set_password,
)
from tests.controlplane.factories import ModelFactory, PlanFactory, TenantFactory

pytestmark = pytest.mark.django_db

STRONG_PASSWORD = "violet-harbour-7-lantern"


def test_tenant_create_with_plan():
    plan = PlanFactory()
    tenant = tenant_create(name="Acme", plan=plan)
    assert Tenant.objects.get(pk=tenant.pk).plan == plan


def test_tenant_create_duplicate_name_raises_and_writes_nothing():
    tenant_create(name="Acme")
    with pytest.raises(ValidationError) as error:
        tenant_create(name="Acme")
    assert "name" in error.value.message_dict
    assert Tenant.objects.count() == 1


def test_user_create_admin_gets_staff_access():
    user = user_create(username="ada", password=STRONG_PASSWORD, role=User.Role.ADMIN)
    user.refresh_from_db()
    assert user.is_staff and user.is_superuser
    assert user.check_password(STRONG_PASSWORD)
    assert STRONG_PASSWORD not in user.password


def test_user_create_operator_is_not_staff():
    user = user_create(username="op", password=STRONG_PASSWORD, role=User.Role.OPERATOR)
    assert not user.is_staff


def test_tenant_member_without_tenant_raises_and_writes_nothing():
    with pytest.raises(ValidationError) as error:
        user_create(username="t", password=STRONG_PASSWORD, role=User.Role.TENANT_MEMBER)
    assert "tenant" in error.value.message_dict
    assert not User.objects.exists()


def test_unknown_role_raises():
    with pytest.raises(ValidationError) as error:
        user_create(username="x", password=STRONG_PASSWORD, role="superhero")
    assert "role" in error.value.message_dict
    assert not User.objects.exists()


def test_weak_password_raises_and_writes_nothing():
    with pytest.raises(ValidationError):
        user_create(username="weak", password="123", role=User.Role.OPERATOR)
    assert not User.objects.exists()


def test_user_set_password_validates():
    user = user_create(username="op", password=STRONG_PASSWORD, role=User.Role.OPERATOR)
    with pytest.raises(ValidationError):
        user_set_password(user=user, password="password")
    user.refresh_from_db()
    assert user.check_password(STRONG_PASSWORD)


def test_api_key_is_shown_once_and_stored_only_as_hash():
    tenant = TenantFactory()
    result = api_key_create(tenant=tenant, name="ci")
    plaintext = result.plaintext
    assert plaintext.startswith("sk-")

    stored = ApiKey.objects.get(pk=result.api_key.pk)
    assert stored.key_hash == hash_api_key(plaintext)
    assert plaintext.startswith(stored.prefix) and len(stored.prefix) < len(plaintext) // 3
    # The plaintext appears in no column of the row, nor in how the key is displayed.
    row = ApiKey.objects.filter(pk=stored.pk).values().get()
    assert not any(plaintext in str(value) for value in row.values())
    assert plaintext not in str(stored) and plaintext not in repr(stored)
    assert not hasattr(stored, "plaintext")


def test_api_key_with_model_list():
    tenant = TenantFactory()
    a, b, _ = ModelFactory(), ModelFactory(), ModelFactory()
    result = api_key_create(
        tenant=tenant, name="limited", all_models=False, allowed_model_names=[a.public_name, b.public_name]
    )
    assert set(result.api_key.allowed_models.all()) == {a, b}


def test_api_key_with_unknown_model_raises_and_writes_nothing():
    tenant = TenantFactory()
    known = ModelFactory()
    with pytest.raises(ValidationError) as error:
        api_key_create(
            tenant=tenant, name="k", all_models=False, allowed_model_names=[known.public_name, "no-such-model"]
        )
    assert "no-such-model" in str(error.value.message_dict["allowed_models"])
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize(
    ("all_models", "names"),
    [(False, []), (True, ["some-model"])],
    ids=["limited-without-models", "all-models-and-a-list"],
)
def test_api_key_model_choice_must_be_all_or_a_list(all_models, names):
    with pytest.raises(ValidationError) as error:
        api_key_create(tenant=TenantFactory(), name="k", all_models=all_models, allowed_model_names=names)
    assert "allowed_models" in error.value.message_dict
    assert not ApiKey.objects.exists()


def test_api_key_duplicate_name_within_tenant_raises():
    tenant = TenantFactory()
    api_key_create(tenant=tenant, name="ci")
    with pytest.raises(ValidationError):
        api_key_create(tenant=tenant, name="ci")
    assert ApiKey.objects.count() == 1
    # The same name under another tenant is fine.
    api_key_create(tenant=TenantFactory(), name="ci")


def test_api_key_rate_limit_must_be_positive():
    with pytest.raises(ValidationError) as error:
        api_key_create(tenant=TenantFactory(), name="k", rate_limit_per_minute=0)
    assert "rate_limit_per_minute" in error.value.message_dict
    assert not ApiKey.objects.exists()


def test_api_key_expiry_is_stored():
    expires = timezone.now() + timedelta(days=30)
    result = api_key_create(tenant=TenantFactory(), name="k", expires_at=expires)
    assert ApiKey.objects.get(pk=result.api_key.pk).expires_at == expires


def test_api_key_revoke():
    result = api_key_create(tenant=TenantFactory(), name="k")
    api_key_revoke(api_key=result.api_key)
    assert ApiKey.objects.get(pk=result.api_key.pk).revoked


def test_api_key_record_use_writes_at_most_once_a_minute():
    from controlplane.accounts.services import api_key_record_use

    api_key = api_key_create(tenant=TenantFactory(), name="hot").api_key
    now = timezone.now()
    assert api_key_record_use(api_key_id=api_key.pk, at=now)
    assert not api_key_record_use(api_key_id=api_key.pk, at=now + timedelta(seconds=59))
    assert api_key_record_use(api_key_id=api_key.pk, at=now + timedelta(seconds=61))
    api_key.refresh_from_db()
    assert api_key.last_used_at == now + timedelta(seconds=61)


def test_a_keys_monthly_spend_limit_is_an_amount_of_money_at_least_zero():
    api_key = api_key_create(tenant=TenantFactory(), name="k", monthly_spend_limit=Decimal("3")).api_key
    assert ApiKey.objects.get(pk=api_key.pk).monthly_spend_limit == Decimal("3")
    for bad in (Decimal("-0.01"), 2.5, Decimal("NaN")):
        with pytest.raises(ValidationError) as error:
            api_key_set_spend_limit(api_key=api_key, monthly_spend_limit=bad)
        assert "monthly_spend_limit" in error.value.message_dict
    with pytest.raises(ValidationError):
        api_key_create(tenant=api_key.tenant, name="k2", monthly_spend_limit=Decimal("-1"))
    assert api_key_set_spend_limit(api_key=api_key, monthly_spend_limit=None).monthly_spend_limit is None
    assert ApiKey.objects.get(pk=api_key.pk).monthly_spend_limit is None


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
def test_staff_playground_keys_bill_the_staff_tenant_created_once(settings, role):
    from controlplane.accounts.services import playground_key_create
    from controlplane.audit.models import AuditEntry
    from tests.controlplane.factories import UserFactory

    settings.PLAYGROUND_STAFF_TENANT = "Platform team"
    first, second = UserFactory(role=role, tenant=None), UserFactory(role=role, tenant=None)
    keys = [playground_key_create(user=first), playground_key_create(user=second)]

    staff = Tenant.objects.get(name="Platform team")
    assert [key.api_key.tenant_id for key in keys] == [staff.pk, staff.pk]
    assert all(key.api_key.purpose == ApiKey.Purpose.PLAYGROUND for key in keys)
    assert AuditEntry.objects.filter(action=AuditEntry.Action.TENANT_CREATE, actor=first).count() == 1


def test_a_members_playground_key_bills_their_own_tenant_never_the_staff_tenant(settings):
    from controlplane.accounts.services import playground_key_create
    from tests.controlplane.factories import UserFactory

    member = UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory(name="Acme"))
    assert playground_key_create(user=member).api_key.tenant == member.tenant
    assert not Tenant.objects.filter(name=settings.PLAYGROUND_STAFF_TENANT).exists()
