"""Writes for billing: price tiers, plans, and credit grants and debits on the ledger.

Every write that depends on a tenant's balance or monthly allowance first locks the tenant's
credit account (`lock_credit_accounts`), so concurrent writes for one tenant are serialised and a
balance check cannot be raced. The account's balance moves in the same transaction as every
ledger entry, so it always equals the sum of the ledger. Usage is charged only through credit
holds, placed at admission and settled when the request ends (`billing.holds`).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

from django.core.exceptions import ValidationError
from django.db import connection, transaction

from controlplane.accounts.models import Tenant
from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.billing.models import CreditAccount, CreditEntry, Plan, PriceTier
from controlplane.billing.selectors import credit_balances
from controlplane.billing.sql import as_date, marks, rows
from controlplane.common.money import format_usd, from_micros
from controlplane.common.services import validated_save

_ACCOUNT, _TENANT, _PLAN = CreditAccount._meta.db_table, Tenant._meta.db_table, Plan._meta.db_table


class InsufficientCredit(ValidationError):
    """A debit larger than the tenant's balance."""


@transaction.atomic
def price_tier_create(
    *, name: str, price_per_request: Decimal, reference_price_per_million_tokens: Decimal
) -> PriceTier:
    return validated_save(
        PriceTier(
            name=name,
            price_per_request=price_per_request,
            reference_price_per_million_tokens=reference_price_per_million_tokens,
        )
    )


@transaction.atomic
def plan_create(
    *,
    name: str,
    included_requests_per_month: int,
    rate_limit_per_minute: int,
    max_concurrent_requests: int = 16,
    fair_share_weight: int = 1,
) -> Plan:
    return validated_save(
        Plan(
            name=name,
            included_requests_per_month=included_requests_per_month,
            rate_limit_per_minute=rate_limit_per_minute,
            max_concurrent_requests=max_concurrent_requests,
            fair_share_weight=fair_share_weight,
        )
    )


@dataclass(frozen=True)
class LockedAccounts:
    """Credit accounts locked for the current transaction, by tenant id, and each tenant's
    monthly allowance (its plan's included requests; 0 without a plan)."""

    accounts: dict[int, CreditAccount]
    included_per_month: dict[int, int]


def lock_credit_accounts(*, tenant_ids: Iterable[int]) -> LockedAccounts:
    """The tenants' credit accounts, locked for this transaction and created where missing.

    Locks are always taken in tenant-id order, so two transactions locking overlapping sets of
    tenants cannot deadlock. Only the account rows are locked; the plan comes along to be read. A
    missing account starts from the tenant's ledger sum (ledgers older than accounts); the insert
    ignores a concurrent creator's row, and every later ledger write goes through a locked
    account, so the sum cannot move underneath it. Plain SQL: the gateway's batched holds take
    this lock on every batch, and the ORM's per-query CPU cost showed there.
    """
    ids = sorted(set(tenant_ids))
    lock = " FOR UPDATE OF a" if connection.features.has_select_for_update_of else ""
    query = (
        "SELECT a.tenant_id, a.balance, a.held, a.allowance_month, a.allowance_used, "
        f"p.included_requests_per_month FROM {_ACCOUNT} a JOIN {_TENANT} t ON t.id = a.tenant_id "
        f"LEFT JOIN {_PLAN} p ON p.id = t.plan_id WHERE a.tenant_id IN ({marks(ids)}) "
        f"ORDER BY a.tenant_id{lock}"
    )
    found = rows(query, ids)
    if len(found) < len(ids):
        create_missing_credit_accounts(tenant_ids=[t for t in ids if t not in {row[0] for row in found}])
        found = rows(query, ids)
    return LockedAccounts(
        accounts={
            row[0]: CreditAccount(
                tenant_id=row[0],
                balance=from_micros(row[1]),
                held=from_micros(row[2]),
                allowance_month=as_date(row[3]),
                allowance_used=row[4],
            )
            for row in found
        },
        included_per_month={row[0]: row[5] or 0 for row in found},
    )


def create_missing_credit_accounts(*, tenant_ids: list[int]) -> None:
    """Accounts for these tenants, starting from their ledger sums; existing ones are left alone."""
    sums = credit_balances(tenant_ids=tenant_ids)
    CreditAccount.objects.bulk_create(
        [CreditAccount(tenant_id=t, balance=sums[t]) for t in tenant_ids], ignore_conflicts=True
    )


def _lock_account(tenant: Tenant) -> CreditAccount:
    return lock_credit_accounts(tenant_ids=[tenant.pk]).accounts[tenant.pk]


def _require_positive_amount(amount: Decimal) -> None:
    # Floats cannot represent cents exactly; refusing them keeps every sum in the ledger exact.
    if not isinstance(amount, Decimal):
        raise ValidationError({"amount": f"Give money as a Decimal, not {type(amount).__name__}."})
    if not amount.is_finite() or amount <= 0:
        raise ValidationError({"amount": f"The amount must be a positive number; got {amount}."})


@transaction.atomic
def credit_grant(
    *, tenant: Tenant, amount: Decimal, memo: str = "", created_by=None, idempotency_token=None
) -> CreditEntry:
    _require_positive_amount(amount)
    account = _lock_account(tenant)
    entry = validated_save(
        CreditEntry(
            tenant=tenant,
            kind=CreditEntry.Kind.GRANT,
            amount=amount,
            memo=memo,
            created_by=created_by,
            idempotency_token=idempotency_token,
        )
    )
    account.balance += amount
    account.save(update_fields=["balance"])
    audit_record(
        actor=created_by,
        action=AuditEntry.Action.CREDIT_GRANT,
        target=tenant,
        detail={"amount": amount, "note": memo, "balance": account.balance},
    )
    return entry


@transaction.atomic
def credit_debit(
    *, tenant: Tenant, amount: Decimal, memo: str = "", created_by=None, idempotency_token=None
) -> CreditEntry:
    """Spend credits (a negative adjustment); refuses (InsufficientCredit) rather than take the
    balance below zero or below what requests in flight hold: a hold is credit a running request
    was promised at admission, and its charge must still find it when the request ends."""
    _require_positive_amount(amount)
    account = _lock_account(tenant)
    if amount > account.available:
        held = f" ({format_usd(account.held)} of it held by requests in flight)" if account.held else ""
        raise InsufficientCredit(
            {
                "amount": f"The adjustment of {format_usd(amount)} exceeds what the tenant can give back: a "
                f"balance of {format_usd(account.balance)}{held}, so at most "
                f"{format_usd(max(account.available, Decimal(0)))}."
            }
        )
    entry = validated_save(
        CreditEntry(
            tenant=tenant,
            kind=CreditEntry.Kind.DEBIT,
            amount=-amount,
            memo=memo,
            created_by=created_by,
            idempotency_token=idempotency_token,
        )
    )
    account.balance -= amount
    account.save(update_fields=["balance"])
    audit_record(
        actor=created_by,
        action=AuditEntry.Action.CREDIT_ADJUST,
        target=tenant,
        detail={"amount": -amount, "note": memo, "balance": account.balance},
    )
    return entry
