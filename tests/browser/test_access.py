"""Signing in, and who may open what: each role sees its own sections and gets 403 on the others';
a tenant gets 404 on another tenant's objects and never sees them listed."""

import re

import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.browser.system import log_in

pytestmark = pytest.mark.slow

OPERATOR_SECTIONS = ["Fleet", "Catalog", "Audit log"]
TENANT_SECTIONS = ["Quickstart", "API keys", "Usage", "Requests", "Credits", "Batches", "Playground", "Team"]
SECTIONS = {
    "operator": [*OPERATOR_SECTIONS, "Playground"],
    "admin": [*OPERATOR_SECTIONS, "Requests", "Playground", "Reports", "Tenants", "Staff"],
    "tenant": TENANT_SECTIONS,
}
PAGES = {
    "Fleet": "dashboard:fleet",
    "Catalog": "dashboard:catalog",
    "Audit log": "dashboard:audit",
    "Quickstart": "dashboard:quickstart",
    "API keys": "dashboard:keys",
    "Usage": "dashboard:usage",
    "Playground": "dashboard:playground",
    "Reports": "dashboard:reports",
    "Credits": "dashboard:credits",
    "Team": "dashboard:team",
    "Tenants": "dashboard:tenants",
    "Staff": "dashboard:staff",
    "Requests": "dashboard:requests",
    "Batches": "dashboard:batches",
}


@pytest.mark.parametrize("role", ["operator", "admin", "tenant"])
def test_each_role_logs_in_and_sees_its_sections(open_page, system, role):
    page = open_page()
    login = system.login(role)
    log_in(page, login)

    expect(page.locator("#home h1")).to_have_text(f"Welcome, {login.username}")
    expect(page.locator("header nav.sections a")).to_have_text(SECTIONS[role])
    # Every section in the menu opens for this role, and its link is marked as the current page.
    for label in SECTIONS[role]:
        page.locator("header nav.sections a", has_text=label).click()
        expect(page).to_have_url(re.compile(re.escape(reverse(PAGES[label])) + "$"))
        expect(page.locator("header nav.sections a[aria-current=page]")).to_have_text(label)


def test_bad_password_shows_an_error_and_signs_nobody_in(open_page, system):
    page = open_page()
    login = system.login("tenant")
    page.goto("/accounts/login/")
    page.fill("#id_username", login.username)
    page.fill("#id_password", login.password + "-wrong")
    page.click("#login button[type=submit]")

    expect(page.locator("#login .error")).to_contain_text("did not match")
    expect(page.locator("#id_username")).to_have_value(login.username)
    response = page.goto(reverse("dashboard:keys"))
    assert "/accounts/login/" in page.url, f"an anonymous visitor reached {response.url}"


@pytest.mark.parametrize(
    ("role", "forbidden"),
    [
        ("tenant", ["Fleet", "Catalog", "Audit log", "Reports", "Tenants", "Staff"]),
        ("operator", ["API keys", "Usage", "Requests", "Credits", "Team", "Reports", "Tenants", "Staff"]),
        ("admin", ["API keys", "Usage", "Credits", "Team"]),
    ],
)
def test_other_roles_pages_answer_403(open_page, role, forbidden):
    page = open_page(role)
    for label in forbidden:
        response = page.goto(reverse(PAGES[label]))
        assert response.status == 403, f"{role} opened {label} ({response.url}): {response.status}"


def _post_from_page(page, url: str) -> int:
    """POST `url` from the page's own JavaScript, with its CSRF token: what a signed-in tenant
    could send by hand."""
    token = page.locator("input[name=csrfmiddlewaretoken]").first.input_value()
    return page.evaluate(
        """async ([url, token]) =>
        (await fetch(url, {method: "POST", headers: {"X-CSRFToken": token, "HX-Request": "true"}})).status""",
        [url, token],
    )


def test_a_tenant_cannot_see_or_revoke_another_tenants_key(open_page, system, orm):
    from controlplane.accounts.models import ApiKey

    other_key = orm(lambda: ApiKey.objects.get(pk=system.seeded.other_tenant_key_id))
    revoke_url = reverse("dashboard:key_revoke", kwargs={"key_id": other_key.pk})
    page = open_page("tenant")
    page.goto(reverse("dashboard:keys"))
    expect(page.locator("main")).not_to_contain_text(other_key.name)
    expect(page.locator("main")).not_to_contain_text(other_key.prefix)

    assert _post_from_page(page, revoke_url) == 404
    assert orm(lambda: ApiKey.objects.get(pk=other_key.pk).revoked) is False
    # The owner sees it, active: the 404 is about whose key it is, not a broken URL.
    owner = open_page("other_tenant")
    owner.goto(reverse("dashboard:keys"))
    expect(owner.locator(f"#key-{other_key.pk} [data-state]")).to_have_attribute("data-state", "active")


def test_pages_send_anonymous_visitors_to_log_in(open_page):
    page = open_page()
    for name in PAGES.values():
        page.goto(reverse(name))
        assert "/accounts/login/" in page.url, f"{name} did not send an anonymous visitor to log in"


def _socket_opens(page, path: str) -> bool:
    """Whether the page's WebSocket to `path` is accepted (a refused handshake never opens)."""
    return page.evaluate(
        """path => new Promise(resolve => {
        const socket = new WebSocket(`ws://${location.host}${path}`);
        socket.onopen = () => { socket.close(); resolve(true); };
        socket.onclose = () => resolve(false);
        setTimeout(() => resolve(false), 10000);
    })""",
        path,
    )


@pytest.mark.parametrize(
    ("path", "allowed", "refused"),
    [
        ("/ws/fleet/", ["operator", "admin"], ["tenant"]),
        ("/ws/home/fleet/", ["operator", "admin"], ["tenant"]),
        ("/ws/playground/", ["tenant", "operator", "admin"], []),
    ],
)
def test_live_sockets_accept_only_their_roles(open_page, path, allowed, refused):
    for role in allowed + refused + [None]:
        page = open_page(role)
        page.goto(reverse("login"))
        assert _socket_opens(page, path) is (role in allowed), f"{path} as {role or 'anonymous'}"
