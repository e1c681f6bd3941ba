"""The 403, 404 and 500 pages: styled like the dashboard, with its menu and a way home, and never
Django's debug page listing the routes."""

import pytest
from django.test import RequestFactory
from django.urls import reverse
from django.views.defaults import server_error

from controlplane.accounts.models import User
from tests.controlplane.factories import TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def tenant_client(client):
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory()))
    return client


def _assert_dashboard_error_page(response, status: int) -> str:
    page = response.content.decode()
    assert response.status_code == status
    assert f'data-status="{status}"' in page and "css/app.css" in page
    assert f'href="{reverse("dashboard:home")}"' in page
    assert "URLconf" not in page and "Traceback" not in page
    return page


def test_a_missing_page_is_the_dashboards_404_with_its_menu(tenant_client):
    page = _assert_dashboard_error_page(tenant_client.get("/no-such-page/"), 404)
    assert "Page not found" in page
    assert f'href="{reverse("dashboard:keys")}"' in page  # the signed-in reader's own sections
    assert "controlplane.urls" not in page and "internal/" not in page


def test_another_roles_page_is_the_dashboards_403(tenant_client):
    page = _assert_dashboard_error_page(tenant_client.get(reverse("dashboard:fleet")), 403)
    assert "Not available to your role" in page and 'id="topbar-menu"' in page


def test_an_anonymous_404_offers_the_login_page(client):
    page = _assert_dashboard_error_page(client.get("/no-such-page/"), 404)
    assert f'href="{reverse("login")}"' in page


def test_the_500_page_renders_without_a_request_context():
    # Django renders 500.html with no context processors (the failure may be in one of them).
    page = _assert_dashboard_error_page(server_error(RequestFactory().get("/")), 500)
    assert "Something went wrong" in page
