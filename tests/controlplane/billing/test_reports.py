"""Latency percentiles of the completed requests in a period."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from controlplane.billing.models import UsageRecord
from controlplane.billing.reports import usage_latency
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import ModelFactory, TenantFactory, usage_record_settled

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)


def _funded_tenant():
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("100"))
    return tenant


def test_usage_latency_nearest_rank_percentiles_of_completed_requests_in_the_period():
    tenant, model = _funded_tenant(), ModelFactory()
    for latency in range(100, 2100, 100):  # 20 requests: 100 ms .. 2000 ms
        usage_record_settled(
            tenant=tenant, model=model, at=T0, total_latency_ms=latency, time_to_first_token_ms=latency // 10
        )
    usage_record_settled(tenant=tenant, model=model, at=T0, status=UsageRecord.Status.FAILED, total_latency_ms=99_000)
    usage_record_settled(tenant=tenant, model=model, at=T0 - timedelta(days=1), total_latency_ms=50_000)
    usage_record_settled(tenant=_funded_tenant(), model=model, at=T0, total_latency_ms=60_000)

    latency = usage_latency(since=T0 - timedelta(hours=1), until=T0 + timedelta(hours=1), tenant=tenant)
    assert (latency.requests, latency.p50_ms, latency.p95_ms) == (20, 1000, 1900)
    assert (latency.ttft_p50_ms, latency.ttft_p95_ms) == (100, 190)


def test_usage_latency_without_requests_is_empty():
    latency = usage_latency(since=T0, until=T0 + timedelta(hours=1), tenant=TenantFactory())
    assert (latency.requests, latency.p50_ms, latency.p95_ms, latency.ttft_p50_ms) == (0, None, None, None)


def test_usage_latency_skips_requests_without_a_first_token():
    tenant, model = _funded_tenant(), ModelFactory()
    usage_record_settled(tenant=tenant, model=model, at=T0, total_latency_ms=40, time_to_first_token_ms=None)
    latency = usage_latency(since=T0, until=T0 + timedelta(seconds=1), tenant=tenant)
    assert (latency.p50_ms, latency.ttft_p50_ms) == (40, None)
