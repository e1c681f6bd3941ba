"""Ledger entries an admin makes by hand: grants and adjustments with a reason, under a bound,
confirmed when large, audited, once per form token, and never below what requests in flight hold."""

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from uuid import uuid4

import pytest
from django.contrib.admin import site as admin_site
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connections
from django.test import RequestFactory, override_settings

from controlplane.accounts.models import User
from controlplane.audit.models import AuditEntry
from controlplane.billing.holds import HoldRequest, credit_holds_place
from controlplane.billing.ledger import ConfirmationRequired, credit_entry_by_admin
from controlplane.billing.models import CreditEntry
from controlplane.billing.selectors import credit_available, credit_balance
from controlplane.common.admin import ReadOnlyAdmin
from tests.controlplane.factories import ApiKeyFactory, ModelFactory, PriceTierFactory, TenantFactory, UserFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("bounds")]

NOW = datetime(2026, 5, 10, 12, 0, tzinfo=UTC)


@pytest.fixture
def bounds():
    with override_settings(CREDIT_ENTRY_MAX_USD=Decimal("1000"), CREDIT_CONFIRM_ABOVE_USD=Decimal("100")):
        yield


@pytest.fixture
def admin():
    return UserFactory(role=User.Role.ADMIN, tenant=None)


def _enter(tenant, admin, amount: str, *, reason="Pilot", confirmed=False, token=None) -> CreditEntry:
    return credit_entry_by_admin(
        tenant=tenant,
        amount=Decimal(amount),
        reason=reason,
        actor=admin,
        idempotency_token=token or uuid4(),
        confirmed=confirmed,
    )


def _nothing_written(tenant) -> bool:
    return not CreditEntry.objects.filter(tenant=tenant).exists() and not AuditEntry.objects.exists()


def test_a_grant_and_an_adjustment_are_entries_with_their_reason_and_audit(admin):
    tenant = TenantFactory()
    _enter(tenant, admin, "30", reason="Welcome")
    adjustment = _enter(tenant, admin, "-12.5", reason="  Grant was too large  ")
    assert (adjustment.kind, adjustment.amount, adjustment.memo) == ("debit", Decimal("-12.5"), "Grant was too large")
    assert credit_balance(tenant=tenant) == Decimal("17.5")
    audit = AuditEntry.objects.get(action=AuditEntry.Action.CREDIT_ADJUST)
    assert audit.actor == admin and audit.detail == {
        "amount": "-12.5",
        "note": "Grant was too large",
        "balance": "17.500000",
    }
    assert AuditEntry.objects.filter(action=AuditEntry.Action.CREDIT_GRANT).count() == 1


@pytest.mark.parametrize("reason", ["", "   "])
def test_an_entry_without_a_reason_is_refused(admin, reason):
    tenant = TenantFactory()
    with pytest.raises(ValidationError) as refused:
        _enter(tenant, admin, "5", reason=reason)
    assert "Give a reason" in refused.value.message_dict["reason"][0]
    assert _nothing_written(tenant)


@pytest.mark.parametrize("amount", ["1000.000001", "-1000.01"])
def test_an_entry_over_the_bound_is_refused_even_when_confirmed(admin, amount):
    tenant = TenantFactory()
    _enter(tenant, admin, "500", confirmed=True)
    with pytest.raises(ValidationError) as refused:
        _enter(tenant, admin, amount, confirmed=True)
    message = refused.value.message_dict["amount"][0]
    assert "more than one entry may move ($1,000.00, the CREDIT_ENTRY_MAX_USD setting)" in message
    assert CreditEntry.objects.filter(tenant=tenant).count() == 1


def test_the_bound_itself_is_allowed(admin):
    tenant = TenantFactory()
    assert _enter(tenant, admin, "1000", confirmed=True).amount == Decimal("1000")


def test_a_large_grant_needs_confirmation(admin):
    tenant = TenantFactory()
    token = uuid4()
    with pytest.raises(ConfirmationRequired) as refused:
        _enter(tenant, admin, "100.01", token=token)
    assert "tick the box" in refused.value.message_dict["confirm"][0]
    assert _nothing_written(tenant)
    assert _enter(tenant, admin, "100", token=uuid4()).amount == Decimal("100")  # at the threshold: no step
    assert _enter(tenant, admin, "100.01", token=token, confirmed=True).amount == Decimal("100.01")


def test_a_large_adjustment_needs_confirmation_too(admin):
    tenant = TenantFactory()
    _enter(tenant, admin, "500", confirmed=True)
    with pytest.raises(ConfirmationRequired):
        _enter(tenant, admin, "-200")
    assert credit_balance(tenant=tenant) == Decimal("500")


def test_a_double_submit_makes_one_entry(admin):
    tenant = TenantFactory()
    token = uuid4()
    first = _enter(tenant, admin, "5", token=token)
    again = _enter(tenant, admin, "5", token=token)
    assert again.pk == first.pk and credit_balance(tenant=tenant) == Decimal("5")
    assert CreditEntry.objects.filter(tenant=tenant).count() == 1 == AuditEntry.objects.count()


def test_a_token_used_for_one_tenant_cannot_write_for_another(admin):
    token = uuid4()
    _enter(TenantFactory(), admin, "5", token=token)
    other = TenantFactory()
    with pytest.raises(ValidationError, match="already used for another tenant"):
        _enter(other, admin, "5", token=token)
    assert credit_balance(tenant=other) == 0


def test_an_adjustment_cannot_take_what_requests_in_flight_hold(admin):
    tenant = TenantFactory()
    model = ModelFactory(price_tier=PriceTierFactory(price_per_request=Decimal("2")))
    _enter(tenant, admin, "10")
    credit_holds_place(
        requests=[HoldRequest("in-flight", tenant.pk, model.pk, ApiKeyFactory(tenant=tenant).pk, 3)],
        at=NOW,
        expires_at=NOW + timedelta(minutes=11),
    )
    assert credit_available(tenant=tenant) == Decimal("4")
    with pytest.raises(ValidationError) as refused:
        _enter(tenant, admin, "-4.01")
    message = refused.value.message_dict["amount"][0]
    assert "a balance of $10.00 ($6.00 of it held by requests in flight), so at most $4.00." in message
    assert credit_balance(tenant=tenant) == Decimal("10")
    _enter(tenant, admin, "-4")
    assert credit_balance(tenant=tenant) == Decimal("6") and credit_available(tenant=tenant) == 0


def test_zero_is_not_an_entry(admin):
    tenant = TenantFactory()
    with pytest.raises(ValidationError, match="non-zero"):
        _enter(tenant, admin, "0")
    assert _nothing_written(tenant)


@pytest.mark.django_db(transaction=True)
def test_a_form_submitted_twice_at_once_makes_one_entry(require_postgres, bounds):
    """Two posts of one form racing (a double click): the account lock serialises them, and the
    second finds the first's entry."""
    tenant, admin = TenantFactory(), UserFactory(role=User.Role.ADMIN, tenant=None)
    token, start, entries = uuid4(), threading.Barrier(2), []

    def submit():
        try:
            start.wait()
            entries.append(_enter(tenant, admin, "5", token=token).pk)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(entries) == 2 and len(set(entries)) == 1
    assert credit_balance(tenant=tenant) == Decimal("5") and AuditEntry.objects.count() == 1


def test_the_ledger_cannot_be_added_to_edited_or_deleted_in_the_admin():
    model_admin = admin_site._registry[CreditEntry]
    request = RequestFactory().get("/admin/")
    assert isinstance(model_admin, ReadOnlyAdmin)
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request) and not model_admin.has_delete_permission(request)


@pytest.mark.parametrize("who", ["operator", "tenant_admin", "nobody"])
def test_only_an_admin_makes_entries(who):
    tenant = TenantFactory()
    actor = {
        "operator": lambda: UserFactory(role=User.Role.OPERATOR, tenant=None),
        "tenant_admin": lambda: UserFactory(tenant=tenant, tenant_role=User.TenantRole.ADMIN),
        "nobody": lambda: None,
    }[who]()
    with pytest.raises(PermissionDenied, match="Only an admin"):
        _enter(tenant, actor, "5")
    assert _nothing_written(tenant)
