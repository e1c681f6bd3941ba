"""The request log and usage by model and key, from real traffic: a request made with the openai
SDK shows in its tenant's request log with the figures the SDK saw, filters narrow the log, the
CSV export carries it; an admin filters the log by tenant; the usage page breaks the period down
by model and by key."""

import csv
import io
import re

import openai
import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.integration.conftest import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def sdk_request(system, orm):
    """One chat completion through /v1 with the demo tenant's key and the openai SDK, recorded:
    (its request id, the usage the SDK saw)."""
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
    client = openai.OpenAI(base_url=f"{system.url}/v1", api_key=system.seeded.api_key, max_retries=0, timeout=60)
    answer = client.chat.completions.with_raw_response.create(
        model=system.seeded.demo_model, max_tokens=6, messages=[{"role": "user", "content": "log me"}]
    )
    request_id, usage = answer.headers["x-request-id"], answer.parse().usage
    wait_until(
        lambda: orm(lambda: UsageRecord.objects.filter(request_id=request_id).exists()),
        timeout=15,
        what="the request's usage record",
        fleet=system.fleet,
    )
    return request_id, usage


def test_a_tenant_finds_an_sdk_request_in_the_log_with_its_figures(open_page, system, sdk_request):
    request_id, usage = sdk_request
    page = open_page("tenant")
    page.goto(reverse("dashboard:usage"))
    page.click("#usage-requests-link")
    expect(page).to_have_url(re.compile(re.escape(reverse("dashboard:requests")) + "$"))
    row = page.locator(f"[data-testid=request-row][data-request-id='{request_id}']")
    expect(row.locator("[data-field=prompt_tokens]")).to_have_text(str(usage.prompt_tokens))
    expect(row.locator("[data-field=completion_tokens]")).to_have_text(str(usage.completion_tokens))
    expect(row.locator("[data-field=outcome]")).to_have_text("ok")
    expect(row.locator("[data-field=ttft]")).to_have_text(re.compile(r"^\d+$"))
    expect(row).to_contain_text(system.seeded.demo_model)
    expect(page.locator("main")).not_to_contain_text("Tenant")  # a member reads only their own tenant

    # Filters: the request's model keeps it; errors only leaves it out.
    page.select_option("#id_model", system.seeded.demo_model)
    page.click("#requests-submit")
    expect(row).to_be_visible()
    page.select_option("#id_outcome", "error")
    page.click("#requests-submit")
    expect(row).to_have_count(0)
    page.select_option("#id_outcome", "")
    page.click("#requests-submit")

    with page.expect_download() as download:
        page.click("#requests-csv")
    rows = list(csv.DictReader(io.StringIO(open(download.value.path(), encoding="utf-8").read())))
    (mine,) = [r for r in rows if r["request_id"] == request_id]
    assert (int(mine["prompt_tokens"]), int(mine["completion_tokens"]), mine["outcome"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
        "ok",
    )

    other = open_page("other_tenant")
    other.goto(reverse("dashboard:requests"))
    expect(other.locator(f"[data-request-id='{request_id}']")).to_have_count(0)


def test_an_admin_filters_the_log_by_tenant(open_page, system, sdk_request):
    request_id, _ = sdk_request
    page = open_page("admin")
    page.goto(reverse("dashboard:requests"))
    expect(page.locator(f"[data-testid=request-row][data-request-id='{request_id}']")).to_contain_text(
        system.seeded.tenant_name
    )
    page.select_option("#id_tenant", label=system.seeded.other_tenant_name)
    page.click("#requests-submit")
    expect(page.locator(f"[data-request-id='{request_id}']")).to_have_count(0)
    for name in page.locator("[data-testid=request-row] td:nth-child(2)").all_inner_texts():
        assert name == system.seeded.other_tenant_name


def test_usage_by_model_and_by_key(open_page, system, sdk_request):
    page = open_page("tenant")
    page.goto(reverse("dashboard:usage"))
    expect(
        page.locator(f"#usage-by-model [data-testid=usage-row][data-key='{system.seeded.demo_model}']")
    ).to_be_visible()
    expect(page.locator("#usage-by-key [data-testid=usage-row]").first).to_be_visible()
    expect(page.locator("#usage-chart-by-model .uplot")).to_have_count(1)
    expect(page.locator("#usage-chart-by-key .uplot")).to_have_count(1)
    # A range ending before it starts: said beside the field, no breakdown.
    page.fill("#id_start", "2026-03-10")
    page.fill("#id_end", "2026-03-01")
    page.click("#usage-period-submit")
    expect(page.locator("#field-end #error-end")).to_contain_text("on or after the first day")
    expect(page.locator("#usage-by-model")).to_have_count(0)
