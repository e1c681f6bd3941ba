"""Every page of every role at a phone's width (390 px) and a desktop's (1280 px): none scrolls
sideways (wide tables scroll inside their card, long names wrap), each is screenshotted, and on the
phone the header folds its sections behind a Menu button that opens them. The pages are the ones
each role's own menu links to, so a page added to the menu is checked without a change here."""

import re

import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.browser.system import PHONE_VIEWPORT, VIEWPORT, horizontal_overflow

pytestmark = pytest.mark.slow

# The demo tenant's member is its team's admin; the second tenant's member is a plain member.
ROLES = {"tenant admin": "tenant", "member": "other_tenant", "operator": "operator", "admin": "admin"}
WIDTHS = {"phone": PHONE_VIEWPORT, "desktop": VIEWPORT}
# A page of another role's, for its 403 page.
FORBIDDEN = {
    "tenant admin": "dashboard:fleet",
    "member": "dashboard:fleet",
    "operator": "dashboard:keys",
    "admin": "dashboard:keys",
}
MISSING = "/no-such-page/"
# Without spaces, so it cannot wrap at a word: it must break or the keys table would widen the page.
LONG_KEY_NAME = "nightly-export-to-the-data-warehouse-" * 2 + "x" * 26


@pytest.fixture(scope="module")
def long_named_key(system, django_db_blocker):
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    from controlplane.accounts.selectors import tenant_get_by_name
    from controlplane.accounts.services import api_key_create

    def create():
        try:
            api_key_create(tenant=tenant_get_by_name(name=system.seeded.tenant_name), name=LONG_KEY_NAME)
        finally:
            connections.close_all()

    assert len(LONG_KEY_NAME) == 100
    with django_db_blocker.unblock(), ThreadPoolExecutor(max_workers=1) as executor:
        executor.submit(create).result(timeout=60)


def _menu_paths(page) -> list[str]:
    page.goto(reverse("dashboard:home"))
    return [link.get_attribute("href") for link in page.locator("header nav.sections a").all()]


def _slug(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "home"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("role", ROLES)
def test_no_page_scrolls_sideways(open_page, long_named_key, tmp_path, role, width):
    page = open_page(ROLES[role], viewport=WIDTHS[width])
    forbidden = reverse(FORBIDDEN[role])
    paths = [reverse("dashboard:home"), *_menu_paths(page), forbidden, MISSING]
    assert len(paths) > 4, f"the {role}'s menu links to no page"
    overflowing = []
    for path in paths:
        response = page.goto(path)
        expected = {forbidden: 403, MISSING: 404}.get(path, 200)
        assert response.status == expected, f"{path}: {response.status}"
        if expected != 200:  # the dashboard's error page, with the role's menu
            expect(page.locator(f'#error-page[data-status="{expected}"]')).to_be_visible()
            expect(page.locator("header nav.sections a")).not_to_have_count(0)
        page.wait_for_load_state("load")
        shot = tmp_path / f"{_slug(role)}-{_slug(path)}-{WIDTHS[width]['width']}.png"
        page.screenshot(path=shot, full_page=True)
        if (extra := horizontal_overflow(page)) > 0:
            overflowing.append(f"{path} is {extra}px wider than the window ({shot})")
    assert overflowing == []


@pytest.mark.parametrize("role", ROLES)
def test_on_a_phone_the_menu_folds_behind_a_button_that_opens_it(open_page, role):
    page = open_page(ROLES[role], viewport=PHONE_VIEWPORT)
    page.goto(reverse("dashboard:home"))
    sections, toggle = page.locator("header nav.sections"), page.locator("#menu-toggle")
    expect(sections).to_be_hidden()
    expect(toggle).to_have_attribute("aria-expanded", "false")
    toggle.click()
    expect(toggle).to_have_attribute("aria-expanded", "true")
    expect(sections).to_be_visible()
    expect(page.locator("header button", has_text="Log out")).to_be_visible()
    link = page.locator("header nav.sections a").last
    target = link.get_attribute("href")
    link.click()
    expect(page).to_have_url(re.compile(re.escape(target) + "$"))
    expect(page.locator("#menu-toggle")).to_be_visible()  # folded again on the new page


def test_on_a_desktop_the_menu_is_open_without_a_button(open_page):
    page = open_page("admin")
    page.goto(reverse("dashboard:home"))
    expect(page.locator("#menu-toggle")).to_be_hidden()
    expect(page.locator("header nav.sections a").first).to_be_visible()


def test_the_playground_is_usable_on_a_phone(open_page):
    page = open_page("tenant", viewport=PHONE_VIEWPORT)
    page.goto(reverse("dashboard:playground"))
    for field in ("#id_model", "#id_message", "#id_system_prompt", "#id_max_tokens"):
        box = page.locator(field).bounding_box()
        assert box["width"] >= 0.7 * PHONE_VIEWPORT["width"], f"{field} is {box['width']:.0f}px wide"
    assert page.locator("#id_message").evaluate("e => e.tagName") == "TEXTAREA"
    assert horizontal_overflow(page) == 0
