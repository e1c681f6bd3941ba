"""Login throttling (django-axes, configured in controlplane.settings): after LOGIN_FAILURE_LIMIT
failures for one username from one address, the dashboard's login and /admin refuse that pair,
even with the right password; other users are not affected; a success clears the count."""

import pytest
from django.contrib.auth import SESSION_KEY
from django.urls import reverse

from controlplane.accounts.models import User
from controlplane.accounts.services import user_create

pytestmark = pytest.mark.django_db

PASSWORD = "a-long-right-password-7"
DASHBOARD, ADMIN = reverse("login"), reverse("admin:login")
LIMIT = 5  # the default (LOGIN_FAILURE_LIMIT unset), locked for 15 minutes (LOGIN_LOCKOUT_MINUTES)


@pytest.fixture
def users():
    return [user_create(username=name, password=PASSWORD, role=User.Role.ADMIN) for name in ("ada", "bea")]


def _log_in(client, url: str, username: str, password: str):
    return client.post(url, {"username": username, "password": password})


@pytest.mark.parametrize("url", [DASHBOARD, ADMIN])
def test_after_the_failure_limit_even_the_right_password_is_refused(client, users, url):
    answers = [_log_in(client, url, "ada", f"wrong-{i}") for i in range(LIMIT)]
    assert [a.status_code for a in answers[:-1]] == [200] * (LIMIT - 1)  # the form again
    locked = _log_in(client, url, "ada", PASSWORD)
    assert answers[-1].status_code == locked.status_code == 429
    page = locked.content.decode()
    assert "Too many failed logins" in page and "After 5 failed attempts, logging in as <strong>ada</strong>" in page
    assert "blocked for 15 minutes" in page
    assert SESSION_KEY not in client.session

    # Another user from the same address is not locked out.
    assert _log_in(client, url, "bea", PASSWORD).status_code == 302
    assert client.session[SESSION_KEY] == str(users[1].pk)


def test_a_successful_login_clears_the_failures(client, users):
    for _ in range(2):
        for i in range(LIMIT - 1):
            assert _log_in(client, DASHBOARD, "ada", f"wrong-{i}").status_code == 200
        assert _log_in(client, DASHBOARD, "ada", PASSWORD).status_code == 302
        client.logout()
