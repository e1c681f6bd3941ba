"""Each role's home page from the running system: the operator sees the fleet with its GPUs and
models, the tenant member this month's spend and today's requests (after one through /v1 with the
SDK-compatible API), the admin revenue, GPU-hours, margin per model and top tenants besides the
operator's section."""

import re

import httpx
import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.integration.conftest import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def one_request(system, orm):
    """One chat completion through /v1 with the demo tenant's key, recorded."""
    from controlplane.billing.models import UsageRecord
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
    before = orm(lambda: UsageRecord.objects.filter(tenant__name=system.seeded.tenant_name).count())
    response = httpx.post(
        f"{system.url}/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {system.seeded.api_key}"},
        json={"model": system.seeded.demo_model, "max_tokens": 4, "messages": [{"role": "user", "content": "home"}]},
    )
    assert response.status_code == 200, response.text
    wait_until(
        lambda: orm(lambda: UsageRecord.objects.filter(tenant__name=system.seeded.tenant_name).count()) > before,
        timeout=15,
        what="the request's usage record",
        fleet=system.fleet,
    )


def test_operator_home_shows_the_fleet(open_page, system, one_request):
    page = open_page("operator")
    page.goto(reverse("dashboard:home"))
    section = page.locator("#home-operator")
    expect(section).to_be_visible()
    # The system's CPU daemon is online (other tests may have registered more hosts).
    assert int(page.inner_text("#home-workers-online")) >= 1
    expect(page.locator("#home-gpus-busy")).to_have_text(re.compile(r"^\d+ / \d+$"))
    expect(page.locator("#home-requests-per-s")).not_to_have_text("—")
    expect(page.locator("#home-errors")).to_have_text("0")
    expect(page.locator("#home-tenant")).to_have_count(0)
    expect(page.locator("#home-admin")).to_have_count(0)


def test_tenant_home_shows_spend_allowance_requests_latency_and_keys(open_page, system, one_request):
    page = open_page("tenant")
    page.goto(reverse("dashboard:home"))
    expect(page.locator("#home-tenant")).to_be_visible()
    assert int(page.inner_text("#home-requests-today")) >= 1
    expect(page.locator("#home-latency")).to_contain_text(" ms")
    expect(page.locator("#home-spend")).to_contain_text("$")
    expect(page.locator("#home-allowance-left")).not_to_have_text("—")  # the demo plan includes requests
    expect(page.locator("[data-testid=home-key-row]").first).to_be_visible()  # the demo key, just used
    expect(page.locator("#home-operator")).to_have_count(0)
    expect(page.locator("#home-admin")).to_have_count(0)

    other = open_page("other_tenant")  # another tenant sees its own figures only
    other.goto(reverse("dashboard:home"))
    expect(other.locator("#home-requests-today")).to_have_text("0")


def test_admin_home_shows_revenue_margin_per_model_and_top_tenants_and_the_fleet(open_page, system, one_request):
    page = open_page("admin")
    page.goto(reverse("dashboard:home"))
    expect(page.locator("#home-operator")).to_be_visible()  # an admin may do all an operator does
    expect(page.locator("#home-admin")).to_be_visible()
    expect(page.locator("#home-revenue")).to_contain_text("$")
    expect(page.locator("#home-gpu-hours")).to_have_text(re.compile(r"^\d+\.\d\d$"))
    expect(page.locator(f"[data-testid=home-margin-row][data-model='{system.seeded.demo_model}']")).to_be_visible()
    expect(
        page.locator(f"[data-testid=home-top-tenant-row][data-tenant='{system.seeded.tenant_name}']")
    ).to_be_visible()


def test_the_operators_home_is_redrawn_live_over_the_fleets_websocket(open_page):
    page = open_page("operator")
    page.goto(reverse("dashboard:home"))
    # Drawn by the consumer (the page itself says "Connecting…"), swapped in by the ws extension.
    expect(page.locator("#home-live-status")).to_have_attribute("data-connected", "true")
    expect(page.locator("#home-live-status")).to_have_text("Live")
    expect(page.locator("#home-workers-online")).to_have_text(re.compile(r"^[1-9]"))
