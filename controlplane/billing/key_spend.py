"""API keys' monthly spend limits: each limited key's budget, read under a lock while holds are
placed, and each key's monthly spend, added up when holds are settled and read by the keys page.

A key's spend this month plus what its requests in flight hold may never go above its limit. The
check runs inside the transaction that places the holds (`billing.holds`), after the key's row is
locked, so two requests of one key are decided one after the other and never both fit into the
last of the budget. Settlement moves an amount from a hold to the month's spend in one
transaction, and one statement sees both or neither, so the sum below never counts a charge
twice or misses it.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal

from django.db import connection
from django.db.models import OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce

from controlplane.accounts.models import ApiKey
from controlplane.billing.models import CreditHold, KeySpend
from controlplane.billing.selectors import month_start
from controlplane.billing.sql import adapt, marks, rows
from controlplane.common.money import MoneyField, from_micros

_KEY, _SPEND, _HOLD = ApiKey._meta.db_table, KeySpend._meta.db_table, CreditHold._meta.db_table


@dataclass
class KeyBudget:
    """A limited key's monthly limit and what is already committed against it this month."""

    limit: Decimal
    committed: Decimal  # charged this month plus held by its requests in flight

    @property
    def left(self) -> Decimal:
        return self.limit - self.committed


def lock_key_budgets(*, key_ids: Iterable[int | None], month: date) -> dict[int, KeyBudget]:
    """The budgets of those keys that have a monthly spend limit, by key id; their rows stay
    locked until the transaction ends. Keys without a limit are neither returned nor locked."""
    ids = sorted({key_id for key_id in key_ids if key_id is not None})
    if not ids:
        return {}
    # NO KEY UPDATE: settlements insert usage records that reference the key (a KEY SHARE lock),
    # and must not wait for a placement.
    lock = " FOR NO KEY UPDATE" if connection.vendor == "postgresql" else ""
    limits = {
        row[0]: from_micros(row[1])
        for row in rows(
            f"SELECT id, monthly_spend_limit FROM {_KEY} WHERE id IN ({marks(ids)}) "
            f"AND monthly_spend_limit IS NOT NULL ORDER BY id{lock}",
            ids,
        )
    }
    if not limits:
        return {}
    # A statement of its own, after the lock was granted: it sees every hold and settlement
    # committed by the transactions this one waited for.
    limited = sorted(limits)
    committed = dict(
        rows(
            f"SELECT k.id, COALESCE((SELECT s.spent FROM {_SPEND} s WHERE s.api_key_id = k.id AND s.month = %s), 0) "
            f"+ COALESCE((SELECT SUM(h.amount) FROM {_HOLD} h WHERE h.api_key_id = k.id), 0) "
            f"FROM {_KEY} k WHERE k.id IN ({marks(limited)})",
            [adapt(month), *limited],
        )
    )
    return {
        key_id: KeyBudget(limit=limit, committed=from_micros(committed[key_id])) for key_id, limit in limits.items()
    }


def key_spend_add(*, charges: dict[int, Decimal], month: date) -> None:
    """Add each key's charges (key id -> amount) to its spend in `month`, in one statement.

    Every key's spend is counted, limited or not, so a limit set in the middle of a month applies
    to what the key already spent that month."""
    charged = sorted((key_id, amount) for key_id, amount in charges.items() if amount > 0)
    if not charged:
        return
    values = ", ".join(["(%s, %s, %s)"] * len(charged))
    params = [value for key_id, amount in charged for value in (key_id, adapt(month), amount)]
    rows(
        f"INSERT INTO {_SPEND} (api_key_id, month, spent) VALUES {values} "
        f"ON CONFLICT (api_key_id, month) DO UPDATE SET spent = {_SPEND}.spent + EXCLUDED.spent",
        params,
        fetch=False,
    )


def api_keys_with_spend(*, keys: QuerySet[ApiKey], at: datetime) -> QuerySet[ApiKey]:
    """`keys`, each with `spent_this_month`: what it was charged in `at`'s calendar month (UTC)."""
    spent = KeySpend.objects.filter(api_key=OuterRef("pk"), month=month_start(at)).values("spent")
    return keys.annotate(spent_this_month=Coalesce(Subquery(spent), Value(0), output_field=MoneyField()))
