"""Reads for billing: the credit balance, the usage counts pricing depends on, and expired holds."""

from datetime import UTC, date, datetime, time
from decimal import Decimal

from django.db.models import QuerySet, Sum

from controlplane.billing.models import MICRO, CreditAccount, CreditEntry, CreditHold, Plan, PriceTier, UsageRecord


def credit_balance(*, tenant) -> Decimal:
    """The tenant's credits: by definition the sum of its ledger entries."""
    total = credit_entries_for_tenant(tenant=tenant).aggregate(total=Sum("amount"))["total"]
    if total is None:
        return Decimal("0")
    # PostgreSQL sums NUMERIC exactly; SQLite (the embedded demo) sums in floating point, so the
    # result is brought back to the ledger's resolution of one millionth.
    return total.quantize(MICRO)


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
    records = UsageRecord.objects.filter(tenant=tenant, created_at__gte=since).exclude(
        status=UsageRecord.Status.FAILED
    )
    if until is not None:
        records = records.filter(created_at__lt=until)
    return records.aggregate(total=Sum("num_requests"))["total"] or 0


def plan_allowance_left(*, tenant, now: datetime) -> int | None:
    """Requests left this month (UTC) of the plan's included allowance, or None without a plan.

    Counted from the month's usage records as pricing counts them (failed requests are free), plus
    the requests in flight whose holds took from the allowance, so the figure matches what the next
    request will be charged."""
    plan = tenant.plan
    if plan is None:
        return None
    month = month_start(now)
    used = usage_billable_count_since(tenant=tenant, since=datetime.combine(month, time.min, tzinfo=UTC))
    held = CreditHold.objects.filter(tenant=tenant, allowance_month=month).aggregate(
        total=Sum("included_requests"))["total"] or 0
    return max(0, plan.included_requests_per_month - used - held)


def credit_holds_expired(*, now: datetime, limit: int = 500) -> list[str]:
    """Request ids of holds past their expiry (their gateway died mid-request), oldest first."""
    return list(
        CreditHold.objects.filter(expires_at__lt=now).order_by("expires_at")
        .values_list("request_id", flat=True)[:limit]
    )


def credit_entries_for_tenant(*, tenant) -> QuerySet[CreditEntry]:
    return CreditEntry.objects.filter(tenant=tenant)


def price_tier_get_by_name(*, name: str) -> PriceTier | None:
    return PriceTier.objects.filter(name=name).first()


def plan_get_by_name(*, name: str) -> Plan | None:
    return Plan.objects.filter(name=name).first()
