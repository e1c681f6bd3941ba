"""How a dashboard view answers a form post, django-htmx style: an htmx request gets the fragment it
swaps in; a plain post (no JavaScript) is redirected back to its page with the outcome as messages."""

from collections.abc import Callable, Iterable

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect


def fragment_or_redirect(
    request: HttpRequest,
    fragment: Callable[[], HttpResponse],
    *,
    to: str,
    success: str = "",
    errors: Iterable[str] = (),
) -> HttpResponse:
    """`fragment` is called only for htmx, so a plain post pays for none of its queries; `to` names
    the page's URL; `success` and `errors` are shown there as messages."""
    if request.htmx:
        return fragment()
    if success:
        messages.success(request, success)
    for text in errors:
        messages.error(request, text)
    return redirect(to)


def run_action(
    request: HttpRequest, action: Callable[[], object], fragment: Callable[..., HttpResponse], *, to: str, success: str
) -> HttpResponse:
    """A one-button action (unload, drain, deploy): call `action` (a service). A refusal reaches htmx
    as `fragment(action_error=...)`, shown beside the button, and a plain post as the page's message."""
    try:
        action()
    except ValidationError as exc:
        messages = exc.messages
        return fragment_or_redirect(request, lambda: fragment(action_error=" ".join(messages)), to=to, errors=messages)
    return fragment_or_redirect(request, fragment, to=to, success=success)
