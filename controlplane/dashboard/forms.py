"""What every dashboard form does with a service's answer. Forms check shapes (numbers, choices);
the rules live in the services, whose ValidationErrors go beside the fields they name."""

from collections.abc import Callable
from typing import TypeVar

from django import forms
from django.core.exceptions import ValidationError

T = TypeVar("T")


def apply_service_errors(form: forms.Form, exc: ValidationError, *, rename: dict[str, str] | None = None) -> None:
    """Attach a service's ValidationError to the form: each message beside the field it names
    (renamed where the form calls it otherwise), the rest at the top of the form."""
    if not hasattr(exc, "error_dict"):
        form.add_error(None, exc)
        return
    for name, errors in exc.message_dict.items():
        name = (rename or {}).get(name, name)
        form.add_error(name if name in form.fields else None, errors)


def submit(form: forms.Form, service: Callable[[dict], T], *, rename: dict[str, str] | None = None) -> T | None:
    """What `service` returns for the form's cleaned data; None when the form is invalid or the
    service refuses, and then `form.errors` says why (see apply_service_errors)."""
    if not form.is_valid():
        return None
    try:
        return service(form.cleaned_data)
    except ValidationError as exc:
        apply_service_errors(form, exc, rename=rename)
        return None


def form_error_messages(form: forms.Form) -> list[str]:
    """The form's errors as lines for a page's messages (after a plain post), each with its field's label."""
    return [
        f"{form.fields[field].label}: {text}" if field in form.fields else text
        for field, errors in form.errors.items()
        for text in errors
    ]
