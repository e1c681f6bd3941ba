"""Ledger entries an admin makes by hand: a grant (credits added) or an adjustment (credits taken
back, a negative entry). Each needs a reason, stays under CREDIT_ENTRY_MAX_USD, is confirmed when
it moves more than CREDIT_CONFIRM_ABOVE_USD, is audited, and is written once per form submission
(its idempotency token). Nothing is edited or deleted: a mistake is corrected by a new entry.
"""

from decimal import Decimal
from uuid import UUID

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction

from controlplane.accounts.models import Tenant, User
from controlplane.billing.models import CreditEntry
from controlplane.billing.services import credit_debit, credit_grant, lock_credit_accounts
from controlplane.common.money import format_usd


class ConfirmationRequired(ValidationError):
    """A large entry that the admin has not confirmed yet: the form asks again with a checkbox."""


def _check_manual_entry(*, amount: Decimal, reason: str, confirmed: bool) -> None:
    if not reason.strip():
        raise ValidationError({"reason": "Give a reason: the tenant sees it and the audit log keeps it."})
    if not isinstance(amount, Decimal) or not amount.is_finite() or amount == 0:
        raise ValidationError({"amount": f"The amount must be a non-zero number of dollars; got {amount}."})
    bound = settings.CREDIT_ENTRY_MAX_USD
    if abs(amount) > bound:
        raise ValidationError(
            {
                "amount": f"{format_usd(abs(amount))} is more than one entry may move ({format_usd(bound)}, "
                "the CREDIT_ENTRY_MAX_USD setting)."
            }
        )
    if abs(amount) > settings.CREDIT_CONFIRM_ABOVE_USD and not confirmed:
        raise ConfirmationRequired(
            {
                "confirm": f"{format_usd(abs(amount))} is above {format_usd(settings.CREDIT_CONFIRM_ABOVE_USD)}: "
                "tick the box to confirm it."
            }
        )


@transaction.atomic
def credit_entry_by_admin(
    *, tenant: Tenant, amount: Decimal, reason: str, actor, idempotency_token: UUID, confirmed: bool = False
) -> CreditEntry:
    """A grant (`amount` > 0) or an adjustment (`amount` < 0) made by `actor`. An adjustment may
    take the balance down to what requests in flight hold, never below (`credit_debit`). A second
    call with the same token returns the first call's entry and writes nothing."""
    if getattr(actor, "role", None) != User.Role.ADMIN:
        raise PermissionDenied("Only an admin may grant or take back credits.")
    _check_manual_entry(amount=amount, reason=reason, confirmed=confirmed)
    # The tenant's account lock serialises submissions, so a double submit finds its first entry.
    lock_credit_accounts(tenant_ids=[tenant.pk])
    earlier = CreditEntry.objects.filter(idempotency_token=idempotency_token).first()
    if earlier is not None:
        if earlier.tenant_id != tenant.pk:
            raise ValidationError("This form was already used for another tenant; reload the page.")
        return earlier
    write = credit_grant if amount > 0 else credit_debit
    return write(
        tenant=tenant, amount=abs(amount), memo=reason.strip(), created_by=actor, idempotency_token=idempotency_token
    )
