"""Reads for billing: the credit balance, the usage counts pricing depends on, and expired holds."""

from datetime import UTC, date, datetime
from decimal import Decimal

from django.db.models import QuerySet, Sum

from controlplane.billing.models import CreditAccount, CreditEntry, CreditHold, Plan, PriceTier, UsageRecord
from controlplane.common.money import from_micros, money_sum


def credit_balance(*, tenant) -> Decimal:
    """The tenant's credits: by definition the sum of its ledger entries."""
    return credit_entries_for_tenant(tenant=tenant).aggregate(total=money_sum("amount"))["total"]


def credit_available(*, tenant) -> Decimal:
    """What new requests may still spend: the balance less the credit held by requests in flight."""
    account = CreditAccount.objects.filter(tenant=tenant).first()
    if account is None:
        return credit_balance(tenant=tenant)
    return account.available


def month_start(moment: datetime) -> date:
    """The first day of `moment`'s month: allowances reset at each calendar month in UTC."""
    return moment.astimezone(UTC).date().replace(day=1)


def usage_billable_count_since(*, tenant, since: datetime, until: datetime | None = None) -> int:
    """Requests since `since` (and before `until`) that count against the plan's allowance: n
    choices count n times; failed requests do not count."""
    records = UsageRecord.objects.filter(tenant=tenant, created_at__gte=since).exclude(status=UsageRecord.Status.FAILED)
    if until is not None:
        records = records.filter(created_at__lt=until)
    return records.aggregate(total=Sum("num_requests"))["total"] or 0


def credit_balances(*, tenant_ids) -> dict[int, Decimal]:
    """Each tenant's balance (the sum of its ledger) by tenant id, in one query; 0 without entries."""
    sums = dict(
        CreditEntry.objects.filter(tenant_id__in=list(tenant_ids))
        .values("tenant_id")
        .annotate(total=Sum("amount"))
        .values_list("tenant_id", "total")
    )
    return {tenant_id: sums.get(tenant_id, from_micros(0)) for tenant_id in tenant_ids}


def credit_holds_expired(*, now: datetime, limit: int = 500) -> list[str]:
    """Request ids of holds past their expiry (their gateway died mid-request), oldest first."""
    return list(
        CreditHold.objects.filter(expires_at__lt=now)
        .order_by("expires_at")
        .values_list("request_id", flat=True)[:limit]
    )


def credit_entries_for_tenant(*, tenant) -> QuerySet[CreditEntry]:
    return CreditEntry.objects.filter(tenant=tenant)


def credit_entries_recent(*, tenant, limit: int | None = 20, kinds=None) -> list[CreditEntry]:
    """The tenant's latest ledger entries (of `kinds`, when given; all of them without a `limit`),
    newest first, with who made them."""
    entries = credit_entries_for_tenant(tenant=tenant).select_related("created_by", "usage_record__model")
    if kinds:
        entries = entries.filter(kind__in=kinds)
    return list(entries[:limit])


def price_tier_get_by_name(*, name: str) -> PriceTier | None:
    return PriceTier.objects.filter(name=name).first()


def plans_all() -> QuerySet[Plan]:
    return Plan.objects.all()


def plan_get_by_name(*, name: str) -> Plan | None:
    return Plan.objects.filter(name=name).first()


def tenant_fair_share_weight(*, tenant_id: int) -> int:
    """The tenant's share of a busy GPU: its plan's weight, 1 without a plan."""
    weight = Plan.objects.filter(tenants__pk=tenant_id).values_list("fair_share_weight", flat=True).first()
    return 1 if weight is None else weight
