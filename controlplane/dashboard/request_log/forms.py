"""The request log's filters, from the query string: a range of days, a model, a key, an outcome,
and for admins a tenant. A tenant member's choices are only their own tenant's keys."""

from datetime import timedelta

from django import forms
from django.utils import timezone

from controlplane.accounts.models import ApiKey, Tenant
from controlplane.catalog.models import Model
from controlplane.dashboard.reports.forms import PeriodForm

DEFAULT_DAYS = 7
OUTCOME_CHOICES = [("", "Any"), ("ok", "OK"), ("error", "Error"), ("client_gone", "Client gone")]


class _KeyChoice(forms.ModelChoiceField):
    def label_from_instance(self, key: ApiKey) -> str:
        return f"{key.name} ({key.prefix}…)"


class RequestLogForm(PeriodForm):
    tenant = forms.ModelChoiceField(Tenant.objects.order_by("name"), required=False, empty_label="All tenants")
    model = forms.ModelChoiceField(Model.objects.order_by("public_name"), to_field_name="public_name",
                                   required=False, empty_label="All models")
    key = _KeyChoice(ApiKey.objects.none(), required=False, empty_label="All keys")
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
        keys = ApiKey.objects.none() if tenant is None else ApiKey.objects.filter(
            tenant=tenant, purpose=ApiKey.Purpose.API).order_by("name", "pk")
        self.fields["key"].queryset = keys
        if tenant is None:
            self.fields["key"].help_text = "Pick a tenant to choose one of its keys."

    @classmethod
    def from_query(cls, query, *, tenant: Tenant | None = None) -> "RequestLogForm":
        return cls(cls.query_data(query, start=timezone.now().date() - timedelta(days=DEFAULT_DAYS - 1)),
                   tenant=tenant)

    def filters(self) -> dict:
        """request_log's filters (tenant aside, which the view decides)."""
        data = self.cleaned_data
        return {"model": data["model"], "api_key": data["key"], "outcome": data["outcome"] or None}
