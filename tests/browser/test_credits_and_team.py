"""An admin grants credits (confirming a large grant) and takes some back, and the tenant sees each
entry; a tenant admin invites someone with a link, who joins with their own login and is then
removed; key creation reaches the audit log."""

import re

import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.browser.system import PASSWORD

pytestmark = pytest.mark.slow


def _balance(orm, tenant_name: str) -> str:
    from controlplane.accounts.selectors import tenant_get_by_name
    from controlplane.billing.selectors import credit_balance
    from controlplane.dashboard.templatetags.money import usd

    return usd(orm(lambda: credit_balance(tenant=tenant_get_by_name(name=tenant_name))))


def test_an_admin_grants_credits_and_the_tenant_sees_them(open_page, system, orm):
    tenant_name = system.seeded.tenant_name
    admin = open_page("admin")
    admin.goto(reverse("dashboard:tenants"))
    admin.locator(f'[data-testid=tenant-row][data-tenant-name="{tenant_name}"] a').click()
    expect(admin.locator("#tenant-name")).to_have_text(tenant_name)
    admin.fill("#id_amount", "12.34")
    admin.fill("#id_reason", "Browser-test top-up")
    admin.click("#grant-submit")

    expect(admin.locator("#grant-done")).to_contain_text("Browser-test top-up")
    balance = _balance(orm, tenant_name)
    expect(admin.locator("#credits-balance")).to_have_text(balance)
    expect(admin.locator("[data-testid=credit-grant]").first).to_contain_text("+$12.34")

    tenant = open_page("tenant")
    tenant.goto(reverse("dashboard:credits"))
    expect(tenant.locator("#credits-balance")).to_have_text(balance)
    grant = tenant.locator("[data-testid=credit-grant]", has_text="Browser-test top-up")
    expect(grant).to_contain_text("+$12.34")
    # The demo plan includes no free requests (make run's costs show from the first request).
    expect(tenant.locator("[data-testid=credits-allowance-left]")).to_have_text("None")
    expect(tenant.locator("#credits-explained")).to_contain_text("included in plan")

    # The grant is in the audit log, with who made it.
    admin.goto(reverse("dashboard:audit") + "?action=credit.grant")
    expect(admin.locator("[data-testid=audit-row]").first).to_contain_text(system.login("admin").username)
    expect(admin.locator("[data-testid=audit-row]").first).to_contain_text("12.34")


def test_a_bad_grant_says_why_beside_the_field(open_page, system):
    admin = open_page("admin")
    admin.goto(reverse("dashboard:tenants"))
    admin.locator(f'[data-testid=tenant-row][data-tenant-name="{system.seeded.tenant_name}"] a').click()
    admin.fill("#id_amount", "0")
    admin.fill("#id_reason", "nothing")
    admin.click("#grant-submit")
    expect(admin.locator("#error-amount")).to_contain_text("greater than or equal to")
    expect(admin.locator("#grant-done")).to_have_count(0)


def test_a_large_grant_is_confirmed_first_and_an_adjustment_takes_credits_back(open_page, system, orm):
    """Above CREDIT_CONFIRM_ABOVE_USD ($500 by default) the form asks to confirm; an adjustment is
    a negative entry the tenant sees with its reason."""
    tenant_name = system.seeded.tenant_name
    admin = open_page("admin")
    admin.goto(reverse("dashboard:tenants"))
    admin.locator(f'[data-testid=tenant-row][data-tenant-name="{tenant_name}"] a').click()
    admin.fill("#id_amount", "600")
    admin.fill("#id_reason", "Browser-test large grant")
    admin.click("#grant-submit")
    expect(admin.locator("#error-confirm")).to_contain_text("tick the box to confirm it")
    expect(admin.locator("#grant-done")).to_have_count(0)
    admin.check("#id_confirm")
    admin.click("#grant-submit")
    expect(admin.locator("#grant-done")).to_contain_text("Granted $600.00 (Browser-test large grant)")

    admin.select_option("#id_direction", "adjustment")
    admin.fill("#id_amount", "600")
    admin.fill("#id_reason", "Browser-test correction")
    admin.click("#grant-submit")
    admin.check("#id_confirm")
    admin.click("#grant-submit")
    expect(admin.locator("#grant-done")).to_contain_text("Took back $600.00 (Browser-test correction)")
    balance = _balance(orm, tenant_name)
    expect(admin.locator("#credits-balance")).to_have_text(balance)

    tenant = open_page("tenant")
    tenant.goto(reverse("dashboard:credits"))
    adjustment = tenant.locator("[data-testid=credit-grant][data-kind=debit]", has_text="Browser-test correction")
    expect(adjustment).to_contain_text("Adjustment")
    expect(adjustment).to_contain_text("-$600.00")
    expect(tenant.locator("#credits-balance")).to_have_text(balance)


def test_a_tenant_admin_invites_a_member_who_joins_and_is_removed(open_page, system):
    alice = open_page("tenant")
    alice.goto(reverse("dashboard:team"))
    alice.select_option("#id_tenant_role", "member")
    alice.fill("#id_note", "Carol from data")
    alice.click("#invite-submit")
    link = alice.locator("#invite-link")
    expect(link).to_have_text(re.compile(r"^http://.+/invite/\S+/$"))
    url = link.inner_text()
    expect(alice.locator("[data-testid=invitation-row]", has_text="Carol from data")).to_be_visible()

    carol = open_page()
    carol.goto(url)
    expect(carol.locator("#invitation h1")).to_have_text(f"Join {system.seeded.tenant_name}")
    carol.fill("#id_username", "carol")
    carol.fill("#id_password", PASSWORD)
    carol.fill("#id_password_again", PASSWORD)
    with carol.expect_navigation():
        carol.click("#invitation-accept")
    expect(carol.locator("header .who")).to_contain_text("carol")
    carol.goto(reverse("dashboard:keys"))
    expect(carol.locator("#keys h1")).to_have_text("API keys")

    # The link is spent.
    stranger = open_page()
    stranger.goto(url)
    expect(stranger.locator("#invitation-refusal")).to_have_text("This invitation has already been used.")

    alice.reload()
    row = alice.locator('[data-testid=member-row][data-username="carol"]')
    expect(row).to_be_visible()
    expect(alice.locator("[data-testid=invitation-row]", has_text="Carol from data")).to_have_count(0)
    alice.once("dialog", lambda dialog: dialog.accept())
    row.locator("[data-testid=member-remove]").click()
    expect(row).to_have_count(0)
    carol.goto(reverse("dashboard:keys"))
    expect(carol).to_have_url(re.compile(r"/accounts/login/"))


def test_the_last_tenant_admin_cannot_step_down(open_page, system):
    alice = open_page("tenant")
    alice.goto(reverse("dashboard:team"))
    me = alice.locator(f'[data-testid=member-row][data-username="{system.login("tenant").username}"]')
    me.locator("[data-testid=member-role]").select_option("member")
    expect(alice.locator("#team-error")).to_contain_text("last admin")
    expect(me.locator("[data-testid=member-role]")).to_have_value("admin")


def test_key_creation_and_revocation_reach_the_audit_log(open_page, system):
    tenant = open_page("tenant")
    tenant.goto(reverse("dashboard:keys"))
    tenant.fill("#id_name", "audited key")
    tenant.click("#key-create-submit")
    row = tenant.locator('[data-testid=key-row][data-key-name="audited key"]')
    expect(row).to_be_visible()
    tenant.once("dialog", lambda dialog: dialog.accept())
    row.locator("[data-testid=key-revoke]").click()
    expect(row.locator("[data-state]")).to_have_attribute("data-state", "revoked")

    operator = open_page("operator")
    operator.goto(reverse("dashboard:audit"))
    for action in ("api_key.create", "api_key.revoke"):
        entry = operator.locator(f'[data-testid=audit-row][data-action="{action}"]', has_text="audited key")
        expect(entry).to_contain_text(system.login("tenant").username)
