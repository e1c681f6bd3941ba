"""Usage and reports from real traffic: requests made with the demo tenant's API key show on that
tenant's usage page (and not on another tenant's) and in the admin's reports and CSV export; a bad
report range gets its message beside the field."""

import csv
import io

import httpx
import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.integration.conftest import wait_until

pytestmark = pytest.mark.slow

REQUESTS = 3


def _usage_count(orm, tenant_name: str) -> int:
    from controlplane.billing.models import UsageRecord

    return orm(lambda: UsageRecord.objects.filter(tenant__name=tenant_name).count())


def _chat(system) -> None:
    response = httpx.post(
        f"{system.url}/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {system.seeded.api_key}"},
        json={
            "model": system.seeded.demo_model,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "report me"}],
        },
    )
    assert response.status_code == 200, response.text


@pytest.fixture
def traffic(system, orm):
    """REQUESTS chat completions through /v1 with the demo tenant's key, recorded."""
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
    before = _usage_count(orm, system.seeded.tenant_name)
    for _ in range(REQUESTS):
        _chat(system)
    wait_until(
        lambda: _usage_count(orm, system.seeded.tenant_name) >= before + REQUESTS,
        timeout=15,
        what="the requests' usage records",
        fleet=system.fleet,
    )
    return before


def test_usage_page_counts_the_tenants_own_requests(open_page, system, traffic):
    page = open_page("tenant")
    page.goto(reverse("dashboard:usage"))
    expect(page.locator("#usage-requests")).to_have_text(str(traffic + REQUESTS))
    expect(page.locator("#usage-balance")).to_contain_text("$")
    expect(page.locator("#usage-chart .uplot")).to_have_count(1)
    # The month is on the axis, but the line stops at today: no zeros for days to come.
    last_x = page.evaluate(
        "(() => { const u = document.getElementById('usage-chart').uplot; "
        "return [u.data[0][u.data[0].length - 1], u.scales.x.max]; })()"
    )
    today = page.evaluate("Math.floor(Date.now() / 86400000) * 86400")
    assert last_x[0] == today and last_x[1] >= today, last_x
    expect(page.locator("#usage-table tbody tr")).to_have_count(1)  # all of it today

    other = open_page("other_tenant")
    other.goto(reverse("dashboard:usage"))
    expect(other.locator("#usage-requests")).to_have_text("0")
    expect(other.locator("#usage-empty")).to_be_visible()


def test_admin_reports_by_tenant_with_csv_export(open_page, system, traffic):
    page = open_page("admin")
    page.goto(reverse("dashboard:reports"))
    row = page.locator(f"[data-testid=report-row][data-key='{system.seeded.tenant_name}']")
    expect(row).to_be_visible()
    requests = int(row.locator("td").nth(1).inner_text())
    assert requests >= traffic + REQUESTS
    expect(page.locator(f"[data-testid=report-row][data-key='{system.seeded.other_tenant_name}']")).to_have_count(0)
    expect(page.locator("#report-comparison")).to_contain_text("Per-token pricing would have")
    expect(page.locator("#report-chart-daily .uplot")).to_have_count(1)
    # Tick labels tell their ticks apart (no "0, 0, 0.001"): money with a $ and enough decimals, each
    # money series on an axis of its own; requests as whole numbers in a chart of their own.
    for axis in (1, 2):
        labels = page.evaluate(f"document.getElementById('report-chart-daily').uplot.axes[{axis}]._values")
        assert labels and len(set(labels)) == len(labels) and all(label.startswith("$") for label in labels), labels
    request_ticks = page.evaluate("document.getElementById('report-chart-requests').uplot.axes[1]._values")
    assert request_ticks and all(label.replace("k", "").isdigit() for label in request_ticks), request_ticks
    assert page.evaluate(
        "[gpuserveCharts.format('usd', 0.0005, 0.0005), gpuserveCharts.format('usd', 1500, 500),"
        " gpuserveCharts.format('count', 2500000, 500000), gpuserveCharts.format('usd', 0.75, 0.25)]"
    ) == ["$0.0005", "$1.5k", "2.5M", "$0.75"]

    with page.expect_download() as download:
        page.click("#report-csv")
    rows = list(csv.reader(io.StringIO(open(download.value.path(), encoding="utf-8").read())))
    tenant_rows = [r for r in rows[1:] if r and r[0] == system.seeded.tenant_name]
    assert len(tenant_rows) == 1 and int(tenant_rows[0][1]) == requests, rows

    # A range ending before it starts: the message beside the last day, and no report.
    page.fill("#id_start", "2026-03-10")
    page.fill("#id_end", "2026-03-01")
    page.click("#report-submit")
    expect(page.locator("#field-end #error-end")).to_contain_text("on or after the first day")
    expect(page.locator("#field-start #error-start")).to_be_hidden()
    expect(page.locator("#report-totals")).to_have_count(0)
