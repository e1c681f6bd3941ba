"""Reads for usage pages and revenue reports: usage records summed in the database by tenant,
model or day, with what the same traffic would have cost at the per-token reference price.

Every figure comes from one aggregate query (`values(...).annotate(...)`); Python only fills the
days without traffic so that charts have a point per day.

The reference figure is each record's `reference_price`, which settlement computes from the
tier's `reference_price_per_million_tokens` times the request's prompt plus completion tokens.
Failed requests are free at the flat price, so they are left out of the reference too: both
columns then price the same (served) traffic.
"""

import math
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from django.db.models import Case, CharField, Count, F, FloatField, IntegerField, Q, QuerySet, Sum, Value, When
from django.db.models.functions import Coalesce, Concat, TruncDate

from controlplane.accounts.models import ApiKey
from controlplane.billing.models import CreditAccount, UsageRecord
from controlplane.billing.selectors import credit_available, credit_balance, usage_billable_count_since
from controlplane.common.money import money_sum

GROUPINGS = ("tenant", "model", "key", "day")
_FAILED = Q(status=UsageRecord.Status.FAILED)


@dataclass(frozen=True)
class UsageRow:
    """The traffic of one group (a tenant, a model or a day) in a period."""

    key: str  # the tenant's name, the model's public name, the key's name (see _key_label), or YYYY-MM-DD
    requests: int
    failed: int
    revenue: Decimal  # charged at the flat per-request price (the plan's included requests are free)
    reference: Decimal  # the same served requests at the per-token reference price
    gpu_time_s: float
    prompt_tokens: int
    completion_tokens: int
    # Of prompt_tokens, those the replicas' prefix caches served: prefill the GPUs did not compute.
    cached_prompt_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def difference(self) -> Decimal:
        """What per-token pricing would have brought in beyond (or, negative, below) the flat price."""
        return self.reference - self.revenue


@dataclass(frozen=True)
class UsageSummary:
    """A tenant's usage this month and its credit, for the usage page."""

    since: datetime
    totals: UsageRow
    balance: Decimal
    available: Decimal


def period_bounds(start: date, end: date) -> tuple[datetime, datetime]:
    """[start 00:00, the day after end 00:00) in UTC: both days are included."""
    return (
        datetime.combine(start, time.min, tzinfo=UTC),
        datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC),
    )


def month_start_of(moment: datetime) -> datetime:
    """The start (UTC) of `moment`'s calendar month, when monthly allowances reset too."""
    moment = moment.astimezone(UTC)
    return datetime(moment.year, moment.month, 1, tzinfo=UTC)


def _records(*, since: datetime, until: datetime, tenant=None) -> QuerySet[UsageRecord]:
    records = UsageRecord.objects.filter(created_at__gte=since, created_at__lt=until)
    return records if tenant is None else records.filter(tenant=tenant)


_TOTALS = {
    "requests": Count("id"),
    "failed": Count("id", filter=_FAILED),
    "revenue": money_sum("price_charged"),
    "reference": money_sum("reference_price", filter=~_FAILED),
    "gpu_time_s": Coalesce(Sum("gpu_time_s"), Value(0.0), output_field=FloatField()),
    "prompt_tokens": Coalesce(Sum("prompt_tokens"), Value(0), output_field=IntegerField()),
    "completion_tokens": Coalesce(Sum("completion_tokens"), Value(0), output_field=IntegerField()),
    "cached_prompt_tokens": Coalesce(Sum("cached_prompt_tokens"), Value(0), output_field=IntegerField()),
}


def _row(key: str, values: dict) -> UsageRow:
    return UsageRow(key=key, **{name: values[name] for name in _TOTALS})


def _empty_row(key: str) -> UsageRow:
    return UsageRow(
        key=key,
        requests=0,
        failed=0,
        revenue=Decimal("0"),
        reference=Decimal("0"),
        gpu_time_s=0.0,
        prompt_tokens=0,
        completion_tokens=0,
    )


def usage_totals(*, since: datetime, until: datetime, tenant=None) -> UsageRow:
    """All traffic in [since, until), of one tenant or of everyone."""
    return _row("total", _records(since=since, until=until, tenant=tenant).aggregate(**_TOTALS))


def _key_label(*, with_tenant: bool):
    """A key's name (with its prefix, since names are reused after revocation); every playground
    session's short-lived key as one "Playground"; and, across tenants, the tenant's name first."""
    name = Case(
        When(api_key__isnull=True, then=Value("(no key)")),
        When(api_key__purpose=ApiKey.Purpose.PLAYGROUND, then=Value("Playground")),
        default=Concat("api_key__name", Value(" ("), "api_key__prefix", Value("…)")),
        output_field=CharField(),
    )
    return Concat("tenant__name", Value(" · "), name, output_field=CharField()) if with_tenant else name


def usage_by(*, group_by: str, since: datetime, until: datetime, tenant=None) -> list[UsageRow]:
    """Traffic in [since, until) grouped by "tenant", "model", "key" or "day"; days in order, the
    others by revenue (largest first)."""
    if group_by not in GROUPINGS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPINGS)}, got {group_by!r}")
    records = _records(since=since, until=until, tenant=tenant)
    if group_by == "day":
        grouped = (
            records.annotate(key=TruncDate("created_at", tzinfo=UTC)).values("key").annotate(**_TOTALS).order_by("key")
        )
        return [_row(values["key"].isoformat(), values) for values in grouped]
    field = (
        F("tenant__name")
        if group_by == "tenant"
        else F("model__public_name")
        if group_by == "model"
        else _key_label(with_tenant=tenant is None)
    )
    grouped = records.values(key=field).annotate(**_TOTALS).order_by("-revenue", "key")
    return [_row(values["key"], values) for values in grouped]


def usage_daily(*, start: date, end: date, tenant=None) -> list[UsageRow]:
    """One row per day from `start` to `end` (both included), zeros on days without traffic."""
    since, until = period_bounds(start, end)
    found = {row.key: row for row in usage_by(group_by="day", since=since, until=until, tenant=tenant)}
    days = (start + timedelta(days=i) for i in range((end - start).days + 1))
    return [found.get(day.isoformat()) or _empty_row(day.isoformat()) for day in days]


def usage_month_summary(*, tenant, now: datetime) -> UsageSummary:
    since = month_start_of(now)
    until = month_start_of(since + timedelta(days=32))
    return UsageSummary(
        since=since,
        totals=usage_totals(since=since, until=until, tenant=tenant),
        balance=credit_balance(tenant=tenant),
        available=credit_available(tenant=tenant),
    )


@dataclass(frozen=True)
class Allowance:
    """A plan's included requests this month: how many, how many are used (or held by requests in
    flight), and the month they count in, [period_start, period_end)."""

    included: int
    used: int
    period_start: datetime
    period_end: datetime

    @property
    def left(self) -> int:
        return max(0, self.included - self.used)

    @property
    def used_percent(self) -> int:
        return min(100, round(100 * self.used / self.included)) if self.included else 0


def allowance_this_month(*, tenant, now: datetime) -> Allowance:
    """What is left of the tenant's plan allowance in `now`'s month, counted as admission counts it
    (billing.pricing.take_allowance): the account's figure when it counts this month, which
    includes requests in flight; the month's usage records otherwise."""
    since = month_start_of(now)
    included = tenant.plan.included_requests_per_month if tenant.plan_id else 0
    account = CreditAccount.objects.filter(tenant=tenant).first()
    if account is not None and account.allowance_month == since.date():
        used = account.allowance_used
    else:
        used = usage_billable_count_since(tenant=tenant, since=since)
    return Allowance(
        included=included,
        used=min(used, included),
        period_start=since,
        period_end=month_start_of(since + timedelta(days=32)),
    )


@dataclass(frozen=True)
class Latency:
    """Nearest-rank percentiles (ms) of the completed requests in a period; None without any."""

    requests: int
    p50_ms: int | None
    p95_ms: int | None
    ttft_p50_ms: int | None
    ttft_p95_ms: int | None


def _percentile(records: QuerySet[UsageRecord], field: str, share: float) -> int | None:
    # Sorted and picked by the database (ORDER BY ... OFFSET), the same on PostgreSQL and SQLite,
    # so no period's latencies travel to Python.
    values = records.exclude(**{f"{field}__isnull": True})
    count = values.count()
    if count == 0:
        return None
    rank = max(1, math.ceil(share * count))
    return values.order_by(field).values_list(field, flat=True)[rank - 1]


def usage_latency(*, since: datetime, until: datetime, tenant=None) -> Latency:
    """p50 and p95 of total latency and time to first token over completed requests in [since, until)."""
    records = _records(since=since, until=until, tenant=tenant).filter(status=UsageRecord.Status.COMPLETED)
    return Latency(
        requests=records.count(),
        p50_ms=_percentile(records, "total_latency_ms", 0.50),
        p95_ms=_percentile(records, "total_latency_ms", 0.95),
        ttft_p50_ms=_percentile(records, "time_to_first_token_ms", 0.50),
        ttft_p95_ms=_percentile(records, "time_to_first_token_ms", 0.95),
    )
