"""What a request costs: the plan's monthly allowance pays first, the rest is charged the model's
flat per-request price, and each record carries the per-token reference price reports compare."""

from datetime import UTC, date, datetime
from decimal import ROUND_HALF_EVEN, Decimal

from controlplane.billing.models import CreditAccount
from controlplane.billing.selectors import usage_billable_count_since
from controlplane.common.money import MICRO

_TOKENS_PER_PRICE_UNIT = Decimal(1_000_000)


def flat_price(*, price_per_request: Decimal, num_requests: int, included: int = 0) -> Decimal:
    """n choices cost n requests' price; those the monthly allowance pays for (`included`) are free."""
    return price_per_request * (num_requests - included)


def batch_price(*, price_per_request: Decimal, batch_price_per_request: Decimal | None) -> Decimal:
    """A Batch API request's price: the tier's batch price, or half its interactive price."""
    if batch_price_per_request is not None:
        return batch_price_per_request
    return (price_per_request / 2).quantize(MICRO, rounding=ROUND_HALF_EVEN)


def reference_price(*, per_million_tokens: Decimal, tokens: int) -> Decimal:
    """What `tokens` would cost at a per-token rate, to the ledger's micro unit."""
    # Half-even, named here rather than left to the decimal context. At common rates ties are
    # frequent (at 0.50 per million every odd token count is one), and reports add these figures
    # up over many requests: half-up would round every tie up and push each sum upward, half-even
    # rounds ties both ways and leaves sums unbiased. It is also what settlement always wrote, so
    # records from before and after agree.
    price = per_million_tokens * tokens / _TOKENS_PER_PRICE_UNIT
    return price.quantize(MICRO, rounding=ROUND_HALF_EVEN)


def take_allowance(*, account: CreditAccount, included_per_month: int, month: date, requests: int) -> int:
    """How many of `requests` the plan's monthly allowance (`included_per_month`) pays for,
    counted as used on the account."""
    if included_per_month == 0:
        return 0
    since = datetime(month.year, month.month, 1, tzinfo=UTC)
    if account.allowance_month is not None and month < account.allowance_month:
        # Dated in a month before the one the account counts (a backfilled record): that month's
        # records say what was left of its allowance.
        used = usage_billable_count_since(tenant=account.tenant_id, since=since, until=_next_month(since))
        return max(0, min(requests, included_per_month - used))
    if account.allowance_month != month:
        account.allowance_month = month
        account.allowance_used = usage_billable_count_since(tenant=account.tenant_id, since=since)
    included = max(0, min(requests, included_per_month - account.allowance_used))
    account.allowance_used += included
    return included


def _next_month(moment: datetime) -> datetime:
    return moment.replace(year=moment.year + moment.month // 12, month=moment.month % 12 + 1)
