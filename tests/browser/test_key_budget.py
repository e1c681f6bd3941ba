"""A tenant gives a key a monthly spend limit on the API keys page: the API refuses the key's
requests beyond it with key_budget_exceeded, a raised limit lets them through, the row shows the
key's spend this month, and a bad amount is said beside the field. The tenant is this test's own
(other tests count the seeded tenants' requests) and pays for every request (no monthly
allowance), so its spend counts against the limit."""

from decimal import Decimal

import httpx
import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.browser.system import PASSWORD, PAY_AS_YOU_GO_PLAN, Login, log_in
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.slow


def _chat(system, key: str) -> httpx.Response:
    return httpx.post(
        f"{system.url}/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": system.seeded.demo_model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "within budget?"}],
        },
    )


def _budget_tenant_member() -> Login:
    """A tenant of its own on the seeded pay-as-you-go plan, with credit and one member."""
    from controlplane.accounts.models import User
    from controlplane.accounts.services import tenant_create, user_create
    from controlplane.billing.selectors import plan_get_by_name
    from controlplane.billing.services import credit_grant

    tenant = tenant_create(name="Budget tenant", plan=plan_get_by_name(name=PAY_AS_YOU_GO_PLAN))
    credit_grant(tenant=tenant, amount=Decimal("5"))
    user = user_create(username="budget-keeper", password=PASSWORD, role=User.Role.TENANT_MEMBER, tenant=tenant)
    return Login(user.username, PASSWORD, user.role)


def test_a_keys_monthly_spend_limit_is_set_on_the_keys_page_and_enforced(open_page, system, orm):
    from controlplane.fleet.models import Replica

    wait_until(
        lambda: orm(
            lambda: Replica.objects.filter(
                deployment__model__public_name=system.seeded.demo_model, state=Replica.State.READY
            ).exists()
        ),
        timeout=180,
        what="a ready replica of the demo model",
        fleet=system.fleet,
    )
    page = open_page()
    log_in(page, orm(_budget_tenant_member))
    page.goto(reverse("dashboard:keys"))
    page.fill("#id_name", "budgeted")
    page.fill("#id_monthly_spend_limit", "0")
    page.click("#key-create-submit")
    plaintext = page.inner_text("#key-plaintext")
    row = page.locator('[data-testid=key-row][data-key-name="budgeted"]')
    expect(row.locator("[data-testid=key-limit]")).to_have_text("of $0.00")

    refused = _chat(system, plaintext)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "key_budget_exceeded", refused.text

    row.locator("[data-testid=key-budget-input]").fill("1")
    row.locator("[data-testid=key-budget-save]").click()
    expect(row.locator("[data-testid=key-limit]")).to_have_text("of $1.00")
    served = _chat(system, plaintext)
    assert served.status_code == 200, served.text
    cost = served.json()["usage"]["cost"]

    def spend_shown() -> bool:  # the charge is written just after the answer went out
        page.reload()
        return row.locator("[data-testid=key-spent]").inner_text() == f"${cost}"  # 0.002: "$0.002"

    wait_until(spend_shown, timeout=15, what="the key's spend this month", fleet=system.fleet)

    row.locator("[data-testid=key-budget-input]").fill("-5")
    row.locator("[data-testid=key-budget-save]").click()
    expect(row.locator("[data-testid=key-budget-error]")).to_contain_text("greater than or equal to 0")
    expect(row.locator("[data-testid=key-limit]")).to_have_text("of $1.00")  # unchanged
