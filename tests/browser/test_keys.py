"""A tenant creates an API key (shown once), uses it against /v1, revokes it, and the API refuses it;
the create form puts each bad value's message beside its field."""

import re
import time

import httpx
import pytest
from django.urls import reverse
from playwright.sync_api import expect

pytestmark = pytest.mark.slow


def _models_status(system, key: str) -> int:
    return httpx.get(f"{system.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code


def _status_becomes(system, key: str, status: int, *, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while (seen := _models_status(system, key)) != status and time.monotonic() < deadline:
        time.sleep(0.2)
    return seen


def test_create_use_and_revoke_a_key(open_page, system):
    page = open_page("tenant")
    page.goto(reverse("dashboard:keys"))
    page.fill("#id_name", "browser key")
    page.click("#key-create-submit")

    expect(page.locator("#key-created")).to_contain_text("browser key")
    expect(page.locator("#key-plaintext")).to_have_text(re.compile(r"^sk-\S{20,}$"))
    plaintext = page.inner_text("#key-plaintext")
    row = page.locator('[data-testid=key-row][data-key-name="browser key"]')
    expect(row).to_be_visible()  # the list updated in the same response, without a reload
    expect(row).to_contain_text(plaintext[:11])
    expect(row.locator("[data-state]")).to_have_attribute("data-state", "active")
    assert _models_status(system, plaintext) == 200

    # Shown once: a reload lists the key but no longer shows its secret.
    page.reload()
    expect(page.locator('[data-testid=key-row][data-key-name="browser key"]')).to_be_visible()
    expect(page.locator("#key-plaintext")).to_have_count(0)
    assert plaintext not in page.content()

    row = page.locator('[data-testid=key-row][data-key-name="browser key"]')
    page.once("dialog", lambda dialog: dialog.accept())  # "Revoke the key …? This cannot be undone."
    row.locator("[data-testid=key-revoke]").click()
    expect(row.locator("[data-state]")).to_have_attribute("data-state", "revoked")
    expect(row.locator("[data-testid=key-revoke]")).to_have_count(0)
    # Every gateway process hears of the revocation; the API refuses the key from then on.
    assert _status_becomes(system, plaintext, 401) == 401


def test_dismissing_the_confirmation_keeps_the_key(open_page, system):
    page = open_page("tenant")
    page.goto(reverse("dashboard:keys"))
    page.fill("#id_name", "kept key")
    page.click("#key-create-submit")
    row = page.locator('[data-testid=key-row][data-key-name="kept key"]')
    expect(row).to_be_visible()
    plaintext = page.inner_text("#key-plaintext")

    page.once("dialog", lambda dialog: dialog.dismiss())
    row.locator("[data-testid=key-revoke]").click()
    page.reload()
    expect(page.locator('[data-testid=key-row][data-key-name="kept key"] [data-state]')).to_have_attribute(
        "data-state", "active"
    )
    assert _models_status(system, plaintext) == 200


def test_key_form_shows_each_error_beside_its_field(open_page):
    page = open_page("tenant")
    page.goto(reverse("dashboard:keys"))
    page.fill("#id_name", "   ")
    page.fill("#id_rate_limit_per_minute", "0")
    page.fill("#id_max_concurrent_requests", "-3")
    page.click("#key-create-submit")

    expect(page.locator("#field-name #error-name")).to_have_text(re.compile(r"required|name", re.I))
    expect(page.locator("#field-rate_limit_per_minute #error-rate_limit_per_minute")).to_contain_text(
        "greater than or equal to 1"
    )
    expect(page.locator("#field-max_concurrent_requests #error-max_concurrent_requests")).to_contain_text(
        "greater than or equal to 1"
    )
    expect(page.locator("#field-expires_at #error-expires_at")).to_be_hidden()
    # What was typed stays, so only the mistakes need fixing; nothing was created.
    expect(page.locator("#id_rate_limit_per_minute")).to_have_value("0")
    expect(page.locator("#key-created")).to_have_count(0)

    # A name the tenant already uses is refused by the service, and said so on the form.
    page.fill("#id_name", "duplicate name")
    page.fill("#id_rate_limit_per_minute", "")
    page.fill("#id_max_concurrent_requests", "")
    page.click("#key-create-submit")
    expect(page.locator('[data-testid=key-row][data-key-name="duplicate name"]')).to_be_visible()
    page.fill("#id_name", "duplicate name")
    page.click("#key-create-submit")
    expect(page.locator("#key-create")).to_contain_text("already has a key with this name")
    expect(page.locator('[data-testid=key-row][data-key-name="duplicate name"]')).to_have_count(1)


def test_the_quickstart_and_a_key_edit(open_page, system):
    page = open_page("tenant")
    page.goto(reverse("dashboard:keys"))
    page.fill("#id_name", "quickstart key")
    page.click("#key-create-submit")
    plaintext = page.inner_text("#key-plaintext")
    # The first requests come with the new key, whole, this once.
    expect(page.locator("#key-created #quickstart-python")).to_contain_text(plaintext)
    expect(page.locator("#key-created #quickstart-shell")).to_contain_text(f"{system.url}/v1/chat/completions")

    page.locator("header nav.sections a", has_text="Quickstart").click()
    expect(page.locator("[data-testid=quickstart-base-url]")).to_have_text(f"{system.url}/v1")
    expect(page.locator("#quickstart-javascript")).to_contain_text('import OpenAI from "openai"')
    assert plaintext not in page.content()

    page.goto(reverse("dashboard:keys"))
    row = page.locator('[data-testid=key-row][data-key-name="quickstart key"]')
    row.locator("[data-testid=key-edit]").click()
    page.fill("#id_name", "renamed key")
    page.fill("#id_rate_limit_per_minute", "30")
    page.click("#key-edit-submit")
    expect(page).to_have_url(reverse("dashboard:keys"))
    expect(page.locator("[data-testid=flash]").first).to_contain_text("renamed key")
    expect(page.locator('[data-testid=key-row][data-key-name="renamed key"]')).to_be_visible()
    # The same secret still works.
    assert _status_becomes(system, plaintext, 200) == 200
