"""Forms of the admins' tenant pages: a new tenant and a credit grant. They check shapes; the
services validate and write (a grant's amount to the ledger's millionth, positive)."""

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


class CreditGrantForm(forms.Form):
    amount = forms.DecimalField(
        **MONEY_DIGITS,
        min_value=MICRO,
        label="Amount ($)",
        widget=forms.NumberInput(attrs={"step": "0.01", "min": "0"}),
        help_text="Added to the tenant's balance at once.",
    )
    note = forms.CharField(
        max_length=200, label="Note", help_text="Why: shown to the tenant and kept in the audit log."
    )

    def clean_note(self) -> str:
        note = self.cleaned_data["note"].strip()
        if not note:
            raise forms.ValidationError("Say why the credits are granted.")
        return note
