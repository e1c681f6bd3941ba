"""What is left of a plan's monthly allowance, as the credits and usage pages show it."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.billing.reports import allowance_this_month
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import ModelFactory, PlanFactory, TenantFactory, usage_record_settled

pytestmark = pytest.mark.django_db


def test_allowance_counts_this_months_billable_requests():
    tenant = TenantFactory(plan=PlanFactory(included_requests_per_month=3))
    model = ModelFactory()
    credit_grant(tenant=tenant, amount=Decimal("1"))
    now = timezone.now()
    usage_record_settled(tenant=tenant, model=model, at=now)
    usage_record_settled(tenant=tenant, model=model, at=now, status="failed")  # not counted
    allowance = allowance_this_month(tenant=tenant, now=now)
    assert (allowance.included, allowance.used, allowance.left) == (3, 1, 2)
    assert allowance.used_percent == 33
    assert allowance.period_start <= now < allowance.period_end
    for _ in range(4):  # past the allowance: the rest is charged, and nothing is "left" below 0
        usage_record_settled(tenant=tenant, model=model, at=now)
    assert (
        allowance_this_month(tenant=tenant, now=now).left,
        allowance_this_month(tenant=tenant, now=now).used_percent,
    ) == (0, 100)


def test_a_new_month_starts_a_new_allowance():
    tenant = TenantFactory(plan=PlanFactory(included_requests_per_month=5))
    model = ModelFactory()
    usage_record_settled(tenant=tenant, model=model, at=timezone.now())
    next_month = (timezone.now().replace(day=1) + timedelta(days=32)).replace(day=3)
    allowance = allowance_this_month(tenant=tenant, now=next_month)
    assert (allowance.used, allowance.left) == (0, 5)
    assert allowance.period_start == datetime(next_month.year, next_month.month, 1, tzinfo=UTC)


def test_no_plan_means_no_allowance():
    allowance = allowance_this_month(tenant=TenantFactory(plan=None), now=timezone.now())
    assert (allowance.included, allowance.left, allowance.used_percent) == (0, 0, 0)
