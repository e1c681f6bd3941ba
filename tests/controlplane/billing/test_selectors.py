from datetime import UTC, datetime
from decimal import Decimal

import pytest

from controlplane.billing.models import UsageRecord
from controlplane.billing.selectors import credit_balance, usage_billable_count_since
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import ModelFactory, TenantFactory, usage_record_settled

pytestmark = pytest.mark.django_db


def test_credit_balance_of_a_tenant_without_entries_is_zero():
    assert credit_balance(tenant=TenantFactory()) == Decimal("0")


def test_credit_balance_ignores_other_tenants():
    tenant, other = TenantFactory(), TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("3"))
    credit_grant(tenant=other, amount=Decimal("4"))
    assert credit_balance(tenant=tenant) == Decimal("3")


def test_usage_billable_count_since_skips_failures_and_earlier_requests():
    tenant, model = TenantFactory(), ModelFactory()
    credit_grant(tenant=tenant, amount=Decimal("1"))
    moments = [
        datetime(2026, 1, 31, 23, 59, tzinfo=UTC),
        datetime(2026, 2, 1, tzinfo=UTC),
        datetime(2026, 2, 2, tzinfo=UTC),
    ]
    statuses = [UsageRecord.Status.COMPLETED, UsageRecord.Status.CANCELLED, UsageRecord.Status.FAILED]
    for at, status in zip(moments, statuses):
        usage_record_settled(tenant=tenant, model=model, status=status, at=at)
    assert usage_billable_count_since(tenant=tenant, since=datetime(2026, 2, 1, tzinfo=UTC)) == 1
    assert usage_billable_count_since(tenant=tenant, since=datetime(2026, 1, 1, tzinfo=UTC)) == 2
