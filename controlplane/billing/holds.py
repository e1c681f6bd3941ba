"""Services for the gateway's per-request billing: hold credit at admission, settle at the end.

A hold sets a request's price aside (`CreditAccount.held`) before the request is served, so the
number of requests admitted can never exceed what the balance covers, however many arrive at
once. Settling turns the hold into the usage record and its ledger charge in one transaction, or
releases it for requests that are not billed. Both take lists: the gateway batches concurrent
requests into one transaction each way. A hold is consumed exactly once (DELETE ... RETURNING in
the transaction that charges or releases it: a second settlement, or the sweeper racing a slow
gateway, finds nothing), so nothing is charged twice; a hold whose gateway died is settled by the
sweeper (`credit_holds_expire`), so a charge is not lost either.

Both run on every API request, so they are written as a handful of plain SQL statements (the
ORM's per-query CPU cost was most of the gateway's); they work on PostgreSQL and SQLite.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal

from django.db import connection, transaction

from controlplane.accounts.models import ApiKey, Tenant
from controlplane.billing.key_spend import key_spend_add, lock_key_budgets
from controlplane.billing.models import CreditAccount, CreditEntry, CreditHold, Plan, PriceTier, UsageRecord
from controlplane.billing.pricing import flat_price, reference_price, take_allowance
from controlplane.billing.selectors import credit_holds_expired, month_start
from controlplane.billing.services import lock_credit_accounts
from controlplane.billing.sql import adapt, adapt_all, as_date, insert, marks, rows
from controlplane.catalog.models import Model
from controlplane.common.money import from_micros

_ACCOUNT, _HOLD = CreditAccount._meta.db_table, CreditHold._meta.db_table
_RECORD, _ENTRY = UsageRecord._meta.db_table, CreditEntry._meta.db_table
_MODEL, _TIER = Model._meta.db_table, PriceTier._meta.db_table
_TENANT, _PLAN = Tenant._meta.db_table, Plan._meta.db_table
_KEY = ApiKey._meta.db_table
_HOLD_FIELDS = (
    "request_id",
    "tenant_id",
    "api_key_id",
    "model_id",
    "num_requests",
    "included_requests",
    "allowance_month",
    "amount",
    "created_at",
    "expires_at",
)


@dataclass(frozen=True)
class HoldRequest:
    request_id: str
    tenant_id: int
    model_id: int
    api_key_id: int | None = None
    num_requests: int = 1
    # The model's price as the caller last read it (the gateway's routing table, at most a second
    # old), which saves a query per batch; None: read it here.
    price_per_request: Decimal | None = None


@dataclass(frozen=True)
class HoldRefused:
    """Why a request's hold was not placed: the tenant's available credit cannot cover it
    (CREDIT), or it would take its key's spend this month above the key's limit (KEY_BUDGET)."""

    CREDIT = "credit"
    KEY_BUDGET = "key_budget"

    reason: str
    key_limit: Decimal | None = None  # the key's monthly spend limit, for KEY_BUDGET


@dataclass(frozen=True)
class RequestOutcome:
    """How a held request ended. `status` completed or cancelled (after its first token) is
    charged; failed is recorded free, with the `error_code` its client was given; None releases
    the hold without a record (client errors, clients gone before the first token)."""

    request_id: str
    status: str | None
    prompt_tokens: int = 0
    # Of prompt_tokens, those served from the replica's prefix cache.
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token_ms: int | None = None
    total_latency_ms: int = 0
    gpu_time_s: float | None = None
    replica_id: int | None = None
    error_code: str = ""
    batch: bool = False  # a Batch API line: its record says so
    image_count: int = 0


def usage_cached_tokens(usage: dict) -> int:
    """The prompt tokens a replica's usage says its prefix cache served (OpenAI's
    prompt_tokens_details.cached_tokens); 0 when it says nothing usable."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached > 0 else 0


@dataclass(frozen=True)
class Settled:
    request_id: str
    found: bool  # False: the hold was already settled (or swept); nothing was written
    record: UsageRecord | None


def credit_holds_place(
    *, requests: Sequence[HoldRequest], at: datetime, expires_at: datetime
) -> list[CreditHold | HoldRefused]:
    """Hold each request's price, in order; HoldRefused where the tenant's available credit
    (balance less what is already held) cannot cover it, or where it would take the key's spend
    this month above the key's limit. The plan's monthly allowance pays first."""
    if len(requests) == 1 and (hold := _place_one_conditionally(requests[0], at, expires_at)) is not None:
        return [hold]
    return _place_locked(requests, at, expires_at)


def _place_one_conditionally(request: HoldRequest, at: datetime, expires_at: datetime) -> CreditHold | None:
    """The common case in one statement (one round trip, its own transaction): a conditional
    update of the account that holds the price only if the credit covers it, no allowance is left
    to use and the key has no spend limit, and the hold inserted with it. None when that does not
    apply (no credit, an allowance left, a limited key, no account yet, SQLite): then the locked
    path decides."""
    if connection.vendor != "postgresql" or request.price_per_request is None:
        return None
    sql, params = conditional_hold_statement(request, at, expires_at)
    return conditional_hold_result(request, rows(sql, params), at, expires_at)


def conditional_hold_statement(request: HoldRequest, at: datetime, expires_at: datetime) -> tuple[str, dict]:
    """`_place_one_conditionally`'s statement (PostgreSQL) and its parameters, adapted (money in
    micro-units), for callers that run it on their own connection (the gateway's asynchronous
    fast path)."""
    amount = flat_price(price_per_request=request.price_per_request, num_requests=request.num_requests)
    return (
        f"""
        WITH account AS (
            UPDATE {_ACCOUNT} a SET held = a.held + %(amount)s
            FROM {_TENANT} t LEFT JOIN {_PLAN} p ON p.id = t.plan_id
            WHERE a.tenant_id = %(tenant)s AND t.id = a.tenant_id AND a.balance - a.held >= %(amount)s
              AND (COALESCE(p.included_requests_per_month, 0) = 0
                   OR (a.allowance_month = %(month)s AND a.allowance_used >= p.included_requests_per_month))
              AND NOT EXISTS (SELECT 1 FROM {_KEY} k WHERE k.id = %(api_key)s AND k.monthly_spend_limit IS NOT NULL)
            RETURNING a.tenant_id)
        INSERT INTO {_HOLD} ({", ".join(_HOLD_FIELDS)})
        SELECT %(request_id)s, tenant_id, %(api_key)s, %(model)s, %(n)s, 0, NULL, %(amount)s, %(at)s, %(expires)s
        FROM account RETURNING id""",
        adapt_all(
            {
                "amount": amount,
                "tenant": request.tenant_id,
                "month": month_start(at),
                "request_id": request.request_id,
                "api_key": request.api_key_id,
                "model": request.model_id,
                "n": request.num_requests,
                "at": at,
                "expires": expires_at,
            }
        ),
    )


def conditional_hold_result(
    request: HoldRequest, result: list[tuple], at: datetime, expires_at: datetime
) -> CreditHold | None:
    if not result:
        return None
    return CreditHold(
        pk=result[0][0],
        request_id=request.request_id,
        tenant_id=request.tenant_id,
        api_key_id=request.api_key_id,
        model_id=request.model_id,
        num_requests=request.num_requests,
        included_requests=0,
        amount=flat_price(price_per_request=request.price_per_request, num_requests=request.num_requests),
        created_at=at,
        expires_at=expires_at,
    )


def credit_holds_place_locked(
    *, requests: Sequence[HoldRequest], at: datetime, expires_at: datetime
) -> list[CreditHold | HoldRefused]:
    """`credit_holds_place` without its one-statement attempt: for callers that made it already."""
    return _place_locked(requests, at, expires_at)


@transaction.atomic
def _place_locked(
    requests: Sequence[HoldRequest], at: datetime, expires_at: datetime
) -> list[CreditHold | HoldRefused]:
    if not requests:
        return []
    prices = {r.model_id: r.price_per_request for r in requests if r.price_per_request is not None}
    unpriced = list({r.model_id for r in requests} - prices.keys())
    if unpriced:
        prices.update(
            (model_id, from_micros(price))
            for model_id, price in rows(
                f"SELECT m.id, t.price_per_request FROM {_MODEL} m JOIN {_TIER} t "
                f"ON t.id = m.price_tier_id WHERE m.id IN ({marks(unpriced)})",
                unpriced,
            )
        )
    locked = lock_credit_accounts(tenant_ids={r.tenant_id for r in requests})
    accounts = locked.accounts
    month = month_start(at)
    budgets = lock_key_budgets(key_ids=[r.api_key_id for r in requests], month=month)  # after the accounts
    holds: list[CreditHold | HoldRefused] = []
    for request in requests:
        account = accounts[request.tenant_id]
        before = (account.allowance_month, account.allowance_used)
        included = take_allowance(
            account=account,
            included_per_month=locked.included_per_month[request.tenant_id],
            month=month,
            requests=request.num_requests,
        )
        amount = flat_price(
            price_per_request=prices[request.model_id], num_requests=request.num_requests, included=included
        )
        budget = budgets.get(request.api_key_id)
        refused = (
            HoldRefused(HoldRefused.CREDIT)
            if amount > account.available
            else HoldRefused(HoldRefused.KEY_BUDGET, budget.limit)
            if budget is not None and amount > budget.left
            else None
        )
        if refused is not None:
            account.allowance_month, account.allowance_used = before  # give the allowance back
            holds.append(refused)
            continue
        account.held += amount
        if budget is not None:
            budget.committed += amount
        holds.append(
            CreditHold(
                request_id=request.request_id,
                tenant_id=request.tenant_id,
                api_key_id=request.api_key_id,
                model_id=request.model_id,
                num_requests=request.num_requests,
                included_requests=included,
                allowance_month=month if included else None,
                amount=amount,
                created_at=at,
                expires_at=expires_at,
            )
        )
    placed = [hold for hold in holds if isinstance(hold, CreditHold)]
    if placed:
        insert(_HOLD, _HOLD_FIELDS, [[getattr(h, f) for f in _HOLD_FIELDS] for h in placed])
    with connection.cursor() as cursor:
        for account in accounts.values():
            cursor.execute(
                f"UPDATE {_ACCOUNT} SET held = %s, allowance_month = %s, allowance_used = %s WHERE tenant_id = %s",
                adapt_all([account.held, account.allowance_month, account.allowance_used, account.tenant_id]),
            )
    return holds


@transaction.atomic
def credit_holds_settle(*, outcomes: Sequence[RequestOutcome], at: datetime, durable: bool = True) -> list[Settled]:
    """Charge, record or release each outcome's hold, once.

    `durable=False` lets PostgreSQL acknowledge the commit before it reaches the disk (so the
    account row's lock is not held across an fsync). A database crash may then forget the last
    fraction of a second of settlements; their holds come back and expire, and the sweeper charges
    those whose first token had been marked. Only callers that mark first tokens may pass it.
    """
    if not outcomes:
        return []
    if not durable and connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")
    holds = {
        row[0]: row
        for row in rows(
            f"DELETE FROM {_HOLD} WHERE request_id IN ({marks(outcomes)}) RETURNING request_id, tenant_id, "
            "api_key_id, model_id, num_requests, included_requests, allowance_month, amount",
            [o.request_id for o in outcomes],
        )
    }
    model_ids = list({hold[3] for hold in holds.values()})
    models = (
        {
            row[0]: row[1:]
            for row in rows(
                f"SELECT m.id, m.public_name, t.reference_price_per_million_tokens FROM {_MODEL} m "
                f"JOIN {_TIER} t ON t.id = m.price_tier_id WHERE m.id IN ({marks(model_ids)})",
                model_ids,
            )
        }
        if holds
        else {}
    )
    records: list[UsageRecord] = []
    changes: dict[int, list[Decimal]] = {}  # tenant -> [charged, released from held]
    allowance_back: dict[tuple[int, date], int] = {}
    results = []
    for outcome in outcomes:
        hold = holds.pop(outcome.request_id, None)
        if hold is None:
            results.append(Settled(outcome.request_id, found=False, record=None))
            continue
        _, tenant_id, api_key_id, model_id, num_requests, included, allowance_month, amount = hold
        amount = from_micros(amount)
        charged = outcome.status in (UsageRecord.Status.COMPLETED, UsageRecord.Status.CANCELLED)
        change = changes.setdefault(tenant_id, [Decimal("0"), Decimal("0")])
        change[0] += amount if charged else 0
        change[1] += amount
        if not charged and included:
            key = (tenant_id, as_date(allowance_month))
            allowance_back[key] = allowance_back.get(key, 0) + included
        record = None
        if outcome.status is not None:
            record = _record(
                outcome,
                tenant_id,
                api_key_id,
                model_id,
                num_requests,
                models[model_id][1],
                amount if charged else Decimal("0"),
                at,
            )
            records.append(record)
        results.append(Settled(outcome.request_id, found=True, record=record))
    if records:
        _insert_records(records, {model_id: name for model_id, (name, _) in models.items()}, at)
        key_charges: dict[int, Decimal] = {}
        for record in records:
            if record.api_key_id is not None:
                key_charges[record.api_key_id] = key_charges.get(record.api_key_id, Decimal("0")) + record.price_charged
        key_spend_add(charges=key_charges, month=month_start(at))
    with connection.cursor() as cursor:
        # In tenant-id order, as lock_credit_accounts locks them: a batch of several tenants
        # updated in another order deadlocks with a concurrent placement.
        for tenant_id, (charged, released) in sorted(changes.items()):
            cursor.execute(
                f"UPDATE {_ACCOUNT} SET balance = balance - %s, held = held - %s WHERE tenant_id = %s",
                adapt_all([charged, released, tenant_id]),
            )
        for (tenant_id, month), count in allowance_back.items():
            cursor.execute(
                f"UPDATE {_ACCOUNT} SET allowance_used = CASE WHEN allowance_used > %s "
                "THEN allowance_used - %s ELSE 0 END WHERE tenant_id = %s AND allowance_month = %s",
                [count, count, tenant_id, adapt(month)],
            )
    return results


def credit_hold_adopt(*, request_id: str, expires_at: datetime) -> Decimal | None:
    """For a request run again under its own id after the gateway running it died: what is already
    held or charged for it (its hold, renewed to `expires_at` so that the sweeper leaves it to the
    new run; or the charge of a settlement written before the death), or None when nothing was
    held yet and it is held as any request is. The new run's settlement consumes the renewed hold,
    or finds none to consume: charged once either way."""
    with transaction.atomic():
        hold = CreditHold.objects.select_for_update().filter(request_id=request_id).first()
        if hold is not None:
            CreditHold.objects.filter(pk=hold.pk).update(expires_at=expires_at)
            return hold.amount
    # Read after the lock: a sweeper that settled the hold meanwhile has committed its record.
    return UsageRecord.objects.filter(request_id=request_id).values_list("price_charged", flat=True).first()


def credit_holds_expire(*, now: datetime, started: Callable[[list[str]], Iterable[str]]) -> list[Settled]:
    """Settle holds whose gateway died mid-request: charged as cancelled when `started` says the
    request had sent its first token (the client got part of an answer), released otherwise."""
    expired = credit_holds_expired(now=now)
    if not expired:
        return []
    began = set(started(expired))
    return credit_holds_settle(
        outcomes=[
            RequestOutcome(request_id, UsageRecord.Status.CANCELLED if request_id in began else None)
            for request_id in expired
        ],
        at=now,
    )


def _record(
    outcome: RequestOutcome, tenant_id, api_key_id, model_id, num_requests, reference_rate, price: Decimal, at: datetime
) -> UsageRecord:
    total_ms = max(0, int(outcome.total_latency_ms))
    ttft = outcome.time_to_first_token_ms
    prompt, completion = max(0, outcome.prompt_tokens), max(0, outcome.completion_tokens)
    return UsageRecord(
        request_id=outcome.request_id,
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        model_id=model_id,
        replica_id=outcome.replica_id,
        status=outcome.status,
        batch=outcome.batch,
        num_requests=num_requests,
        error_code=outcome.error_code[:40] if outcome.status == UsageRecord.Status.FAILED else "",
        prompt_tokens=prompt,
        cached_prompt_tokens=min(prompt, max(0, outcome.cached_prompt_tokens)),
        completion_tokens=completion,
        image_count=max(0, outcome.image_count),
        time_to_first_token_ms=None if ttft is None else min(max(0, int(ttft)), total_ms),
        total_latency_ms=total_ms,
        gpu_time_s=None if outcome.gpu_time_s is None else max(0.0, float(outcome.gpu_time_s)),
        price_charged=price,
        reference_price=reference_price(per_million_tokens=from_micros(reference_rate), tokens=prompt + completion),
        created_at=at,
    )


_RECORD_FIELDS = (
    "request_id",
    "tenant_id",
    "api_key_id",
    "model_id",
    "replica_id",
    "status",
    "batch",
    "error_code",
    "num_requests",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "image_count",
    "time_to_first_token_ms",
    "total_latency_ms",
    "gpu_time_s",
    "price_charged",
    "reference_price",
    "created_at",
)


def _insert_records(records: list[UsageRecord], model_names: dict[int, str], at: datetime) -> None:
    ids = dict(
        insert(
            _RECORD,
            _RECORD_FIELDS,
            [[getattr(r, f) for f in _RECORD_FIELDS] for r in records],
            returning="request_id, id",
        )
    )
    for record in records:
        record.pk = ids[record.request_id]
    charged = [r for r in records if r.price_charged > 0]
    if charged:
        insert(
            _ENTRY,
            ("tenant_id", "kind", "amount", "memo", "usage_record_id", "created_at"),
            [
                [
                    r.tenant_id,
                    CreditEntry.Kind.USAGE,
                    -r.price_charged,
                    f"{model_names[r.model_id]} request {r.request_id}",
                    r.pk,
                    at,
                ]
                for r in charged
            ],
        )
