"""Running a service from a dashboard form: its refusals land beside the fields they name."""

from django import forms
from django.core.exceptions import ValidationError

from controlplane.dashboard.forms import apply_service_errors, form_error_messages, submit


class SlotForm(forms.Form):
    slot = forms.CharField(label="Worker / GPU")
    count = forms.IntegerField(label="Count")


def _refuse(errors):
    def service(data):
        raise ValidationError(errors)

    return service


def test_submit_returns_what_the_service_returns_for_a_valid_form():
    form = SlotForm({"slot": "a", "count": "2"})
    assert submit(form, lambda data: data["count"] * 10) == 20 and not form.errors


def test_an_invalid_form_never_reaches_the_service():
    called = []
    form = SlotForm({"slot": "a", "count": "many"})
    assert submit(form, called.append) is None and called == []
    assert form_error_messages(form) == ["Count: Enter a whole number."]


def test_a_refusal_goes_beside_the_field_it_names_renamed_or_at_the_top():
    form = SlotForm({"slot": "a", "count": "2"})
    refusal = _refuse({"gpu": "No room on GPU 0.", "deployment": "Raise max_replicas first."})
    assert submit(form, refusal, rename={"gpu": "slot"}) is None
    assert form.errors == {"slot": ["No room on GPU 0."], "__all__": ["Raise max_replicas first."]}
    assert form_error_messages(form) == ["Worker / GPU: No room on GPU 0.", "Raise max_replicas first."]


def test_a_refusal_without_fields_goes_at_the_top():
    form = SlotForm({"slot": "a", "count": "2"})
    form.is_valid()
    apply_service_errors(form, ValidationError("Not now."))
    assert form.non_field_errors() == ["Not now."]
