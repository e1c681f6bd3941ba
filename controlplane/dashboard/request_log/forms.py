"""The request log's filters, from the query string: a range of days, a model, a key, an outcome,
and for admins a tenant. A tenant member's choices are only their own tenant's keys."""

from datetime import timedelta

from django import forms
from django.utils import timezone

from controlplane.accounts.models import ApiKey, Tenant
from controlplane.accounts.selectors import api_key_choices, tenants_by_name
from controlplane.billing.refusals import REFUSED, SHED
from controlplane.catalog.selectors import catalog_models
from controlplane.dashboard.reports.forms import PeriodForm

DEFAULT_DAYS = 7
OUTCOME_CHOICES = [
    ("", "Any"),
    ("ok", "OK"),
    ("error", "Error"),
    ("client_gone", "Client gone"),
    (REFUSED, "Refused"),
    (SHED, "Shed (overloaded)"),
]


class _KeyChoice(forms.ModelChoiceField):
    def label_from_instance(self, key: ApiKey) -> str:
        return f"{key.name} ({key.prefix}…)"


class RequestLogForm(PeriodForm):
    tenant = forms.ModelChoiceField(tenants_by_name(), required=False, empty_label="All tenants")
    model = forms.ModelChoiceField(
        catalog_models(), to_field_name="public_name", required=False, empty_label="All models"
    )
    key = _KeyChoice(api_key_choices(tenant=None), required=False, empty_label="All keys")
    outcome = forms.ChoiceField(choices=OUTCOME_CHOICES, required=False)

    def __init__(self, *args, tenant: Tenant | None = None, **kwargs):
        """`tenant`: the reader's own tenant (a tenant member), whose keys are the choices and
        whose tenant filter is fixed; None for an admin, who picks a tenant to choose its keys."""
        super().__init__(*args, **kwargs)
        if tenant is not None:
            del self.fields["tenant"]
        else:
            try:
                tenant = self.fields["tenant"].clean(self.data.get("tenant"))
            except forms.ValidationError:
                tenant = None  # reported beside the field when the form is cleaned
        self.fields["key"].queryset = api_key_choices(tenant=tenant)
        if tenant is None:
            self.fields["key"].help_text = "Pick a tenant to choose one of its keys."

    @classmethod
    def from_query(cls, query, *, tenant: Tenant | None = None) -> "RequestLogForm":
        return cls(cls.query_data(query, start=timezone.now().date() - timedelta(days=DEFAULT_DAYS - 1)), tenant=tenant)

    def filters(self) -> dict:
        """request_log's filters (tenant aside, which the view decides)."""
        data = self.cleaned_data
        return {"model": data["model"], "api_key": data["key"], "outcome": data["outcome"] or None}
