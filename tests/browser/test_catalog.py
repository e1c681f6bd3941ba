"""The operators' catalog: adding a model checks its weight path against what the chosen worker
reports (the browser-test daemon reports the checkpoints under the system's models folder), bad
values get their message beside the field, and enabling/disabling lands in the audit log."""

import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.browser.system import PHONE_VIEWPORT

pytestmark = pytest.mark.slow

NAME = "browser-model"


def _error(page, field: str):
    return page.locator(f"#field-{field} [data-testid=field-error]")


def test_add_a_model_with_its_path_checked_then_disable_it(open_page, system):
    page = open_page("operator")
    page.goto(reverse("dashboard:catalog"))
    page.click("[data-testid=catalog-add]")
    expect(page).to_have_url(reverse("dashboard:catalog_add"))

    # Bad values: each message beside its field, what was typed kept.
    page.fill("#id_public_name", NAME)
    page.fill("#id_family", "llama")
    page.fill("#id_weights_path", "models/relative")
    page.fill("#id_parameter_count", "4000000")
    page.click("[data-testid=model-save]")
    expect(_error(page, "weights_path")).to_contain_text("Give an absolute path")
    expect(_error(page, "context_length")).to_contain_text("required")
    expect(_error(page, "price_tier")).to_contain_text("required")
    expect(_error(page, "public_name")).to_have_count(0)
    expect(page.locator("#id_public_name")).to_have_value(NAME)

    # A path under the worker's models folder that holds no checkpoint: the live check says so
    # while typing, and saving is refused with the worker's answer beside the field.
    missing = str(system.models_dir / "no-such-model")
    page.fill("#id_context_length", "2048")
    page.select_option("#id_price_tier", index=1)
    page.fill("#id_weights_path", missing)
    page.locator("#id_weights_path").dispatch_event("change")
    expect(page.locator("[data-testid=path-check-result] [data-status=missing]")).to_contain_text(missing)
    page.click("[data-testid=model-save]")
    expect(_error(page, "weights_path")).to_contain_text(
        f"has no checkpoint (a directory with config.json or a .gguf file) at {missing}"
    )

    present = str(system.models_dir / system.seeded.demo_model)
    page.fill("#id_weights_path", present)
    page.locator("#id_weights_path").dispatch_event("change")
    expect(page.locator("[data-testid=path-check-result] [data-status=found]")).to_contain_text(present)
    page.click("[data-testid=model-save]")

    expect(page).to_have_url(reverse("dashboard:catalog"))
    expect(page.locator("[data-testid=flash]").first).to_contain_text(f"Added {NAME}")
    row = page.locator(f"[data-testid=catalog-row][data-model='{NAME}']")
    expect(row).to_have_attribute("data-enabled", "true")
    expect(row).to_contain_text(present)
    expect(row).to_contain_text("Not deployed")

    page.once("dialog", lambda dialog: dialog.accept())  # "Disable …? API requests for it are refused"
    row.locator("[data-testid=catalog-toggle]").click()
    expect(row).to_have_attribute("data-enabled", "false")
    expect(row.locator("[data-testid=model-state]")).to_have_text("Disabled")

    page.goto(reverse("dashboard:audit"))
    for action in ("model.create", "model.disable"):
        expect(
            page.locator(f"[data-testid=audit-row][data-action='{action}']")
            .filter(has_text=NAME)
            .filter(has_text="operator")
        ).to_have_count(1)

    # A disabled model is not offered to tenants.
    tenant = open_page("tenant")
    tenant.goto(reverse("dashboard:playground"))
    expect(tenant.locator(f"#id_model option[value='{NAME}']")).to_have_count(0)
    expect(tenant.locator(f"#id_model option[value='{system.seeded.demo_model}']")).to_have_count(1)


def test_a_model_read_from_its_checkpoint_is_added_then_deleted(open_page, system):
    page = open_page("operator")
    page.goto(reverse("dashboard:catalog_add"))
    # The daemon reports what it read in the demo model's folder; its name is the id it answers to.
    page.fill("#id_checkpoint", system.seeded.demo_model)
    page.click("[data-testid=checkpoint-read]")
    expect(page.locator("[data-testid=checkpoint-facts]")).to_contain_text("LlamaForCausalLM")
    expect(page.locator("#id_weights_path")).to_have_value(str(system.models_dir / system.seeded.demo_model))
    expect(page.locator("#id_family")).to_have_value("llama")
    expect(page.locator("#id_parameter_count")).not_to_have_value("")
    expect(page.locator("#id_context_length")).not_to_have_value("")
    page.fill("#id_public_name", "browser-read-model")
    page.select_option("#id_price_tier", index=1)
    page.click("[data-testid=model-save]")

    expect(page).to_have_url(reverse("dashboard:catalog"))
    row = page.locator("[data-testid=catalog-row][data-model='browser-read-model']")
    expect(row).to_contain_text("llama")
    page.once("dialog", lambda dialog: dialog.accept())  # "Delete …? … cannot be undone."
    row.locator("[data-testid=catalog-delete]").click()
    expect(row).to_have_count(0)

    # A checkpoint no worker has: the reason beside the field.
    page.goto(reverse("dashboard:catalog_add"))
    page.fill("#id_checkpoint", "acme/not-here")
    page.click("[data-testid=checkpoint-read]")
    expect(page.locator("#field-checkpoint [data-testid=field-error]")).to_contain_text(
        "No online worker has acme/not-here under its model roots"
    )


# The text pieces of a row's first four cells (name, family and kind, context, price tier) that take
# more lines than they have words (a hyphen may end a line): a word broken in two.
BROKEN_WORDS = """row => [...row.querySelectorAll("td")].slice(0, 4).flatMap(td => [...td.childNodes])
    .filter(node => node.nodeType === Node.TEXT_NODE || node.tagName === "STRONG")
    .filter(node => {
        const range = document.createRange();
        range.selectNodeContents(node);
        const lines = new Set([...range.getClientRects()].map(rect => Math.round(rect.top)));
        const words = node.textContent.trim().split(/[\\s-]+/).filter(Boolean);
        return lines.size > words.length;
    })
    .map(node => node.textContent.trim())"""


def test_catalog_columns_keep_their_words_whole_beside_a_long_weight_path(open_page):
    """At a desktop's width the weight path wraps, so the other columns keep their words whole."""
    page = open_page("operator")
    page.goto(reverse("dashboard:catalog"))
    rows = page.locator("[data-testid=catalog-row]")
    expect(rows.first).to_be_visible()
    assert [row.evaluate(BROKEN_WORDS) for row in rows.all()] == [[] for _ in rows.all()]


def test_at_a_phones_width_a_weight_path_takes_a_few_lines(open_page):
    """On a phone the table scrolls in its card: a path wraps to a readable width, not a word a line."""
    page = open_page("operator", viewport=PHONE_VIEWPORT)
    page.goto(reverse("dashboard:catalog"))
    paths = page.locator("[data-testid=model-weights-path] code")
    expect(paths.first).to_be_visible()
    lines = paths.evaluate_all("codes => codes.map(code => code.getClientRects().length)")  # one a line
    assert max(lines) <= 4, lines
