"""The dashboard's one answer to a form post: the fragment for htmx, else a redirect with messages."""

from django.contrib.messages import get_messages
from django.contrib.messages.storage.cookie import CookieStorage
from django.core.exceptions import ValidationError
from django.http import HttpResponse
from django.test import RequestFactory
from django_htmx.middleware import HtmxDetails

from controlplane.dashboard.htmx import fragment_or_redirect, run_action


def _post(*, htmx: bool):
    request = RequestFactory().post("/", **({"HTTP_HX_REQUEST": "true"} if htmx else {}))
    request.htmx = HtmxDetails(request)
    request._messages = CookieStorage(request)
    return request


def _messages(request) -> list[tuple[str, str]]:
    return [(m.level_tag, m.message) for m in get_messages(request)]


def test_htmx_gets_the_fragment_and_no_message():
    request = _post(htmx=True)
    response = fragment_or_redirect(request, lambda: HttpResponse("fragment"), to="dashboard:fleet", success="Done.")
    assert (response.status_code, response.content) == (200, b"fragment")
    assert _messages(request) == []


def test_a_plain_post_is_redirected_with_its_messages_and_renders_no_fragment():
    request = _post(htmx=False)
    rendered = []
    response = fragment_or_redirect(
        request, lambda: rendered.append(1), to="dashboard:fleet", success="Done.", errors=["First.", "Second."]
    )
    assert (response.status_code, response["Location"], rendered) == (302, "/fleet/", [])
    assert _messages(request) == [("success", "Done."), ("error", "First."), ("error", "Second.")]


def _refuse():
    raise ValidationError("Not now.")


def _card(action_error: str = "") -> HttpResponse:
    return HttpResponse(f"card:{action_error}")


def test_run_action_shows_a_refusal_beside_the_button_or_as_a_message():
    response = run_action(_post(htmx=True), _refuse, _card, to="dashboard:fleet", success="Done.")
    assert response.content == b"card:Not now."
    request = _post(htmx=False)
    assert run_action(request, _refuse, _card, to="dashboard:fleet", success="Done.").status_code == 302
    assert _messages(request) == [("error", "Not now.")]


def test_run_action_answers_with_the_fragment_or_the_success_message():
    calls = []
    response = run_action(_post(htmx=True), lambda: calls.append(1), _card, to="dashboard:fleet", success="Done.")
    assert response.content == b"card:"
    request = _post(htmx=False)
    run_action(request, lambda: calls.append(1), _card, to="dashboard:fleet", success="Done.")
    assert calls == [1, 1] and _messages(request) == [("success", "Done.")]
