"""An htmx request whose session has ended: `login_required` answers it with a redirect to the login
page, which the browser's XHR follows silently, so htmx would swap the whole login page into the
card that asked for a fragment. This middleware turns that redirect into HX-Redirect, which htmx
follows as a full page load, and sends the reader back to the page they were on after logging in."""

from collections.abc import Callable
from urllib.parse import urlencode, urlsplit

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import resolve_url
from django_htmx.http import HttpResponseClientRedirect


def _is_login_redirect(response: HttpResponse, login_path: str) -> bool:
    return response.status_code in (301, 302, 303, 307, 308) and urlsplit(response["Location"]).path == login_path


def htmx_login_redirect_middleware(get_response: Callable[[HttpRequest], HttpResponse]):
    def middleware(request: HttpRequest) -> HttpResponse:
        response = get_response(request)
        login_path = resolve_url(settings.LOGIN_URL)
        if not getattr(request, "htmx", False) or not _is_login_redirect(response, login_path):
            return response
        # The page the reader sees, not the fragment's URL: that is where logging in leads back to.
        back_to = request.htmx.current_url_abs_path or resolve_url(settings.LOGIN_REDIRECT_URL)
        return HttpResponseClientRedirect(f"{login_path}?{urlencode({'next': back_to})}")

    return middleware
