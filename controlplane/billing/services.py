"""Writes for billing: credit grants and debits on the ledger, and recording a request's usage.

Every write that depends on a tenant's balance or monthly count first locks the tenant's row
(SELECT ... FOR UPDATE), so concurrent requests for one tenant are serialised and a balance
check cannot be raced.
"""

from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal

from django.core.exceptions import ValidationError
from django.db import transaction

from controlplane.accounts.models import Tenant
from controlplane.billing.models import MICRO, CreditEntry, Plan, PriceTier, UsageRecord
from controlplane.billing.selectors import credit_balance, usage_billable_count_since

_TOKENS_PER_PRICE_UNIT = Decimal(1_000_000)


class InsufficientCredit(ValidationError):
    """A debit larger than the tenant's balance."""


@transaction.atomic
def price_tier_create(
    *, name: str, price_per_request: Decimal, reference_price_per_million_tokens: Decimal
) -> PriceTier:
    tier = PriceTier(
        name=name,
        price_per_request=price_per_request,
        reference_price_per_million_tokens=reference_price_per_million_tokens,
    )
    tier.full_clean()
    tier.save()
    return tier


@transaction.atomic
def plan_create(*, name: str, included_requests_per_month: int, rate_limit_per_minute: int) -> Plan:
    plan = Plan(
        name=name,
        included_requests_per_month=included_requests_per_month,
        rate_limit_per_minute=rate_limit_per_minute,
    )
    plan.full_clean()
    plan.save()
    return plan


def _lock_tenant(tenant: Tenant) -> Tenant:
    return Tenant.objects.select_for_update().get(pk=tenant.pk)


def _require_positive_amount(amount: Decimal) -> None:
    # Floats cannot represent cents exactly; refusing them keeps every sum in the ledger exact.
    if not isinstance(amount, Decimal):
        raise ValidationError({"amount": f"Give money as a Decimal, not {type(amount).__name__}."})
    if not amount.is_finite() or amount <= 0:
        raise ValidationError({"amount": f"The amount must be a positive number; got {amount}."})


def _append(entry: CreditEntry) -> CreditEntry:
    entry.full_clean()
    entry.save()
    return entry


@transaction.atomic
def credit_grant(*, tenant: Tenant, amount: Decimal, memo: str = "", created_by=None) -> CreditEntry:
    _require_positive_amount(amount)
    return _append(
        CreditEntry(tenant=tenant, kind=CreditEntry.Kind.GRANT, amount=amount, memo=memo, created_by=created_by)
    )


@transaction.atomic
def credit_debit(*, tenant: Tenant, amount: Decimal, memo: str = "", created_by=None) -> CreditEntry:
    """Spend credits; refuses (InsufficientCredit) rather than take the balance below zero."""
    _require_positive_amount(amount)
    _lock_tenant(tenant)
    balance = credit_balance(tenant=tenant)
    if amount > balance:
        raise InsufficientCredit(
            {"amount": f"The debit of {amount} exceeds the tenant's balance of {balance}."}
        )
    return _append(
        CreditEntry(tenant=tenant, kind=CreditEntry.Kind.DEBIT, amount=-amount, memo=memo, created_by=created_by)
    )


def reference_price(*, price_tier: PriceTier, tokens: int) -> Decimal:
    """What `tokens` would cost at the tier's per-token reference rate."""
    price = price_tier.reference_price_per_million_tokens * tokens / _TOKENS_PER_PRICE_UNIT
    return price.quantize(MICRO, rounding=ROUND_HALF_UP)


def _month_start(moment: datetime) -> datetime:
    # Allowances reset at the start of each calendar month in UTC.
    return moment.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


@transaction.atomic
def usage_record_create(
    *,
    request_id: str,
    tenant: Tenant,
    model,
    status: str,
    prompt_tokens: int,
    completion_tokens: int,
    total_latency_ms: int,
    time_to_first_token_ms: int | None,
    at: datetime,
    api_key=None,
    replica=None,
) -> UsageRecord:
    """Record one finished request and charge it, once: the request id is unique.

    Failed requests are free; the first `included_requests_per_month` billable requests of a
    month are free under the tenant's plan; the rest cost the model's flat per-request price.
    The charge is posted even if it takes the balance below zero: the request has already been
    served, and the gateway checks the balance before it serves one.
    """
    tenant = _lock_tenant(tenant)
    record = UsageRecord(
        request_id=request_id,
        tenant=tenant,
        api_key=api_key,
        model=model,
        replica=replica,
        status=status,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        time_to_first_token_ms=time_to_first_token_ms,
        total_latency_ms=total_latency_ms,
        price_charged=Decimal("0"),
        reference_price=Decimal("0"),
        created_at=at,
    )
    record.full_clean()  # before pricing, so bad token counts are reported as such
    record.price_charged = _request_price(tenant=tenant, model=model, status=status, at=at)
    record.reference_price = reference_price(
        price_tier=model.price_tier, tokens=prompt_tokens + completion_tokens
    )
    record.save()
    if record.price_charged > 0:
        _append(
            CreditEntry(
                tenant=tenant,
                kind=CreditEntry.Kind.USAGE,
                amount=-record.price_charged,
                usage_record=record,
                memo=f"{model.public_name} request {request_id}",
            )
        )
    return record


def _request_price(*, tenant: Tenant, model, status: str, at: datetime) -> Decimal:
    if status == UsageRecord.Status.FAILED:
        return Decimal("0")
    if tenant.plan is not None:
        used = usage_billable_count_since(tenant=tenant, since=_month_start(at))
        if used < tenant.plan.included_requests_per_month:
            return Decimal("0")
    return model.price_tier.price_per_request
