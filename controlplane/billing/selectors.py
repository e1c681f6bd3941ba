"""Reads for billing: the credit balance and the usage counts pricing depends on."""

from datetime import datetime
from decimal import Decimal

from django.db.models import QuerySet, Sum

from controlplane.billing.models import MICRO, CreditEntry, Plan, PriceTier, UsageRecord


def credit_balance(*, tenant) -> Decimal:
    """The tenant's credits: by definition the sum of its ledger entries."""
    total = credit_entries_for_tenant(tenant=tenant).aggregate(total=Sum("amount"))["total"]
    if total is None:
        return Decimal("0")
    # PostgreSQL sums NUMERIC exactly; SQLite (the embedded demo) sums in floating point, so the
    # result is brought back to the ledger's resolution of one millionth.
    return total.quantize(MICRO)


def usage_billable_count_since(*, tenant, since: datetime) -> int:
    """Requests since `since` that count against the plan's allowance (failed ones do not)."""
    return (
        UsageRecord.objects.filter(tenant=tenant, created_at__gte=since)
        .exclude(status=UsageRecord.Status.FAILED)
        .count()
    )


def credit_entries_for_tenant(*, tenant) -> QuerySet[CreditEntry]:
    return CreditEntry.objects.filter(tenant=tenant)


def price_tier_get_by_name(*, name: str) -> PriceTier | None:
    return PriceTier.objects.filter(name=name).first()


def plan_get_by_name(*, name: str) -> Plan | None:
    return Plan.objects.filter(name=name).first()
