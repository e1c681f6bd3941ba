"""What a tenant's credits look like on a page, for the tenant's own Credits page and an admin's
tenant page alike: the plan and what is left of its monthly allowance, the balance, every grant
and adjustment (entries made by hand: few, and each one the tenant should be able to check), and
the latest charges."""

from datetime import datetime

from controlplane.billing.models import CreditEntry
from controlplane.billing.reports import allowance_this_month
from controlplane.billing.selectors import credit_available, credit_balance, credit_entries_recent

RECENT_CHARGES = 10


def credits_context(*, tenant, now: datetime) -> dict:
    return {
        "tenant": tenant,
        "plan": tenant.plan,
        "allowance": allowance_this_month(tenant=tenant, now=now),
        "balance": credit_balance(tenant=tenant),
        "available": credit_available(tenant=tenant),
        "grants": credit_entries_recent(
            tenant=tenant, limit=None, kinds=[CreditEntry.Kind.GRANT, CreditEntry.Kind.DEBIT]
        ),
        "charges": credit_entries_recent(tenant=tenant, limit=RECENT_CHARGES, kinds=[CreditEntry.Kind.USAGE]),
    }
