"""Forms of the tenant pages: they parse and check input; the services decide and write."""

from django import forms

from controlplane.catalog.selectors import model_names_enabled


class ApiKeySettingsForm(forms.Form):
    """What a key is called and may do: set when it is created, editable afterwards."""

    name = forms.CharField(max_length=100, help_text="So you can tell your keys apart, e.g. 'production'.")
    allowed_models = forms.MultipleChoiceField(
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="Tick none to allow every model, including ones added later.",
    )
    rate_limit_per_minute = forms.IntegerField(
        required=False,
        min_value=1,
        label="Requests per minute",
        help_text="Optional; empty means your plan's limit.",
    )
    max_concurrent_requests = forms.IntegerField(
        required=False,
        min_value=1,
        label="Concurrent requests",
        help_text="Optional; empty means your plan's limit.",
    )
    monthly_spend_limit = forms.DecimalField(
        required=False,
        min_value=0,
        max_digits=18,
        decimal_places=2,
        label="Monthly spend limit ($)",
        help_text="Optional; requests that would take this key's spend in a month (UTC) above it are refused.",
    )
    batch_priority = forms.BooleanField(
        required=False,
        label="Batch work",
        help_text="Its requests give way to interactive ones on a busy GPU (for offline jobs).",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["allowed_models"].choices = [(name, name) for name in model_names_enabled()]

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if not name:
            raise forms.ValidationError("Give the key a name.")
        return name

    def service_arguments(self) -> dict:
        data = self.cleaned_data
        return {
            "name": data["name"],
            "all_models": not data["allowed_models"],
            "allowed_model_names": data["allowed_models"],
            "rate_limit_per_minute": data["rate_limit_per_minute"],
            "max_concurrent_requests": data["max_concurrent_requests"],
            "monthly_spend_limit": data["monthly_spend_limit"],
            "batch_priority": data["batch_priority"],
        }

    @classmethod
    def for_key(cls, api_key, data=None) -> "ApiKeySettingsForm":
        """The edit form, filled with the key's settings (or the posted `data`)."""
        initial = {
            "name": api_key.name,
            "allowed_models": [] if api_key.all_models else [m.public_name for m in api_key.allowed_models.all()],
            "rate_limit_per_minute": api_key.rate_limit_per_minute,
            "max_concurrent_requests": api_key.max_concurrent_requests,
            "monthly_spend_limit": api_key.monthly_spend_limit,
            "batch_priority": api_key.batch_priority,
        }
        form = cls(data, initial=initial)
        # A model disabled since keeps its box, so saving the other fields does not drop it unseen.
        choices = dict(form.fields["allowed_models"].choices)
        for name in initial["allowed_models"]:
            choices.setdefault(name, name)
        form.fields["allowed_models"].choices = list(choices.items())
        return form


class ApiKeyCreateForm(ApiKeySettingsForm):
    expires_at = forms.DateTimeField(
        required=False,
        label="Expires",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d"],
        help_text="Optional (UTC). Leave empty for a key that does not expire.",
    )

    def service_arguments(self) -> dict:
        return {**super().service_arguments(), "expires_at": self.cleaned_data["expires_at"]}


class ApiKeyBudgetForm(forms.Form):
    monthly_spend_limit = forms.DecimalField(
        required=False,
        min_value=0,
        max_digits=18,
        decimal_places=2,
        label="Monthly spend limit ($)",
        help_text="Empty: no limit beyond your credit.",
    )
