"""Forms of the admins' tenant pages: a new tenant and a credit grant or adjustment. They check shapes; the
services validate and write (a grant's amount to the ledger's millionth, positive)."""

from decimal import Decimal
from uuid import uuid4

from django import forms

from controlplane.billing.selectors import plans_all
from controlplane.common.money import MICRO, MONEY_DIGITS


class TenantCreateForm(forms.Form):
    name = forms.CharField(max_length=100)
    plan = forms.ModelChoiceField(
        queryset=plans_all(),
        required=False,
        empty_label="No plan",
        help_text="Sets the monthly included requests and rate limits.",
    )

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if not name:
            raise forms.ValidationError("Give the tenant a name.")
        return name


class CreditEntryForm(forms.Form):
    """A grant or an adjustment by hand. `token` is new on every blank form, so a form submitted
    twice (a double click, a resent post) makes one ledger entry."""

    GRANT, ADJUSTMENT = "grant", "adjustment"

    direction = forms.ChoiceField(
        choices=[(GRANT, "Grant: add credits"), (ADJUSTMENT, "Adjustment: take credits back")],
        initial=GRANT,
        label="Entry",
    )
    amount = forms.DecimalField(
        **MONEY_DIGITS,
        min_value=MICRO,
        label="Amount ($)",
        widget=forms.NumberInput(attrs={"step": "0.01", "min": "0"}),
        help_text="Moves the tenant's balance at once; an entry is never edited, only corrected by another.",
    )
    reason = forms.CharField(max_length=200, label="Reason", help_text="Shown to the tenant and kept in the audit log.")
    confirm = forms.BooleanField(required=False, label="I confirm this amount")
    token = forms.UUIDField(
        widget=forms.HiddenInput,
        error_messages={
            "required": "This form is incomplete: reload the page and enter it again.",
            "invalid": "This form is incomplete: reload the page and enter it again.",
        },
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.is_bound:
            self.initial["token"] = uuid4()

    def clean_reason(self) -> str:
        reason = self.cleaned_data["reason"].strip()
        if not reason:
            raise forms.ValidationError("Give a reason: the tenant sees it and the audit log keeps it.")
        return reason

    def signed_amount(self) -> Decimal:
        amount = self.cleaned_data["amount"]
        return amount if self.cleaned_data["direction"] == self.GRANT else -amount
