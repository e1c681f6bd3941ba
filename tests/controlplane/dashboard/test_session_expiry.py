"""An htmx request after the session ended gets HX-Redirect to the login page (a full page load),
never the login page swapped into the card that asked for a fragment."""

from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.sessions.models import Session
from django.http import HttpResponse
from django.shortcuts import redirect
from django.test import RequestFactory
from django.urls import reverse
from django_htmx.middleware import HtmxDetails

from controlplane.accounts.models import User
from controlplane.dashboard.session_expiry import htmx_login_redirect_middleware
from tests.controlplane.factories import TenantFactory, UserFactory

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def _expired_client(client):
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory()))
    assert client.get(reverse("dashboard:keys"), **HTMX).status_code == 200
    Session.objects.all().delete()  # the session ends on the server; the browser still sends its cookie
    return client


def test_an_htmx_request_of_an_ended_session_is_sent_to_the_login_page_it_returns_from(client):
    page = "http://testserver" + reverse("dashboard:keys") + "?show=revoked"
    response = _expired_client(client).post(reverse("dashboard:keys"), **HTMX, HTTP_HX_CURRENT_URL=page)

    assert response.status_code == 200 and "Location" not in response
    target = urlsplit(response["HX-Redirect"])
    assert target.path == reverse("login")
    assert parse_qs(target.query) == {"next": [reverse("dashboard:keys") + "?show=revoked"]}
    assert b"id_password" not in response.content  # no login form to swap into the card


def test_without_a_page_of_this_site_to_return_to_it_returns_home(client):
    response = _expired_client(client).get(
        reverse("dashboard:keys"), **HTMX, HTTP_HX_CURRENT_URL="https://elsewhere.example/keys/"
    )
    assert parse_qs(urlsplit(response["HX-Redirect"]).query) == {"next": [reverse("dashboard:home")]}


def test_a_plain_request_keeps_the_ordinary_redirect(client):
    response = _expired_client(client).get(reverse("dashboard:keys"))
    assert response.status_code == 302 and urlsplit(response["Location"]).path == reverse("login")
    assert "HX-Redirect" not in response


@pytest.mark.parametrize(
    "answer",
    [lambda: redirect("dashboard:fleet"), lambda: HttpResponse("fragment")],
    ids=["other-redirect", "fragment"],
)
def test_other_htmx_answers_pass_unchanged(answer):
    request = RequestFactory().post("/", **HTMX)
    request.htmx = HtmxDetails(request)
    original = answer()
    assert htmx_login_redirect_middleware(lambda _: original)(request) is original
