import pytest
from django.urls import reverse

from controlplane.accounts.models import User
from tests.controlplane.factories import PASSWORD, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


def test_login_page_renders_a_form(client):
    response = client.get(reverse("login"))
    assert response.status_code == 200
    page = response.content.decode()
    assert 'name="username"' in page and 'name="password"' in page and "csrfmiddlewaretoken" in page


def test_home_sends_anonymous_visitors_to_login(client):
    response = client.get(reverse("dashboard:home"))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


@pytest.mark.parametrize(
    ("role", "tenant_role", "label"),
    [
        (User.Role.OPERATOR, User.TenantRole.MEMBER, "Operator"),
        (User.Role.ADMIN, User.TenantRole.MEMBER, "Admin"),
        (User.Role.TENANT_MEMBER, User.TenantRole.ADMIN, "Tenant admin"),
        (User.Role.TENANT_MEMBER, User.TenantRole.MEMBER, "Member"),
    ],
)
def test_logging_in_lands_on_home_which_names_the_role(client, role, tenant_role, label):
    tenant = TenantFactory(name="Acme")
    is_tenant_member = role == User.Role.TENANT_MEMBER
    user = UserFactory(role=role, tenant=tenant if is_tenant_member else None, tenant_role=tenant_role)
    response = client.post(reverse("login"), {"username": user.username, "password": PASSWORD}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("dashboard:home")
    page = response.content.decode()
    assert f'<strong class="role">{label}</strong>' in page
    assert f'<span class="who">{user.username} · {label}</span>' in page  # the header names it alike
    assert ("Acme" in page) == is_tenant_member
    if is_tenant_member:  # and so does the Team page
        team = client.get(reverse("dashboard:team")).content.decode()
        assert f'data-username="{user.username}"' in team and f">{label}<" in team


def test_wrong_password_stays_on_login(client):
    user = UserFactory()
    response = client.post(reverse("login"), {"username": user.username, "password": "wrong"})
    assert response.status_code == 200
    assert "did not match" in response.content.decode()


def test_logout_is_a_post(client):
    client.force_login(UserFactory())
    assert client.post(reverse("logout")).status_code == 302
    assert client.get(reverse("dashboard:home")).status_code == 302
