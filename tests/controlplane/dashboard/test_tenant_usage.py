"""The usage page: this month's requests, spend and balance, by day, only the tenant's own."""

import calendar
from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.billing.reports import month_start_of
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import (
    ModelFactory,
    PriceTierFactory,
    TenantFactory,
    UserFactory,
    usage_record_settled,
)

pytestmark = pytest.mark.django_db


def _model(price: str):
    return ModelFactory(
        price_tier=PriceTierFactory(price_per_request=Decimal(price)),
        context_length=256,
        parameter_count=1,
        gpu_memory_bytes=1,
    )


def _record(tenant, model, at, status="completed", n=1):
    return usage_record_settled(tenant=tenant, model=model, at=at, status=status, num_requests=n)


def test_empty_month_says_what_to_do(client):
    user = UserFactory(role=User.Role.TENANT_MEMBER)
    client.force_login(user)
    page = client.get(reverse("dashboard:usage")).content.decode()
    assert 'id="usage-empty"' in page and 'id="usage-chart"' not in page
    assert 'data-testid="usage-requests">0<' in page and 'data-testid="usage-balance">$0.00<' in page


def test_month_figures_daily_rows_and_isolation(client):
    tenant, other = TenantFactory(), TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("5"))
    credit_grant(tenant=other, amount=Decimal("5"))
    model = _model("0.01")
    now = timezone.now()
    start = month_start_of(now)
    _record(tenant, model, start + timedelta(minutes=1))
    _record(tenant, model, start + timedelta(minutes=2), n=2)
    _record(tenant, model, start + timedelta(minutes=3), status="failed")
    _record(tenant, model, start - timedelta(days=3))  # last month: not counted, but charged
    _record(other, model, start + timedelta(minutes=4))  # another tenant's
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    response = client.get(reverse("dashboard:usage"))
    page = response.content.decode()
    assert 'data-testid="usage-requests">3<' in page  # the failed one counts as a request, free
    assert 'data-testid="usage-spend">$0.03<' in page  # 0.01 + 2 x 0.01
    assert 'data-testid="usage-balance">$4.96<' in page  # 5 - 0.03 - 0.01 (last month)
    first_day = start.date().isoformat()
    assert f'<tr data-day="{first_day}"><td>{first_day}</td><td class="num">3</td><td class="num">1</td>' in page
    chart = response.context["chart"]
    series = {s["label"]: s["values"] for s in chart["series"]}
    assert (
        chart["days"][0] == first_day and series["Requests"][0] == 3 and series["Spend ($)"][0] == pytest.approx(0.03)
    )
    # The chart's axis spans the whole month, its figures (and the table) stop at today: no
    # zeros for days still to come.
    last_day = now.date().replace(day=calendar.monthrange(now.year, now.month)[1]).isoformat()
    assert chart["span"] == [first_day, last_day]
    assert chart["days"][-1] == now.date().isoformat() and len(chart["days"]) == now.day
    assert all(len(values) == now.day for values in series.values()) and sum(series["Requests"]) == 3
    assert len(response.context["days"]) == now.day


def test_usage_by_model_and_by_key_over_a_period(client):
    from tests.controlplane.factories import ApiKeyFactory

    tenant, other = TenantFactory(), TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("5"))
    credit_grant(tenant=other, amount=Decimal("5"))
    chat, embed = _model("0.01"), _model("0.001")
    prod, batch = ApiKeyFactory(tenant=tenant, name="production"), ApiKeyFactory(tenant=tenant, name="batch")
    now = timezone.now()
    for model, key in ((chat, prod), (chat, prod), (embed, batch)):
        usage_record_settled(tenant=tenant, model=model, api_key=key, at=now)
    usage_record_settled(tenant=tenant, model=chat, api_key=batch, at=now - timedelta(days=40))  # before the period
    usage_record_settled(tenant=other, model=chat, api_key=ApiKeyFactory(tenant=other, name="theirs"), at=now)
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    response = client.get(reverse("dashboard:usage"))
    by_model, by_key = response.context["groups"]
    assert [(r.key, r.requests, r.revenue) for r in by_model.rows] == [
        (chat.public_name, 2, Decimal("0.02")),
        (embed.public_name, 1, Decimal("0.001")),
    ]
    assert [(r.key, r.requests) for r in by_key.rows] == [
        (f"production ({prod.prefix}…)", 2),
        (f"batch ({batch.prefix}…)", 1),
    ]
    assert by_key.chart == {"labels": [r.key for r in by_key.rows], "series": [{"label": "Requests", "values": [2, 1]}]}
    assert "theirs" not in response.content.decode()

    earlier = (now - timedelta(days=40)).date().isoformat()
    by_model, by_key = client.get(reverse("dashboard:usage"), {"start": earlier, "end": earlier}).context["groups"]
    assert [(r.key, r.requests) for r in by_key.rows] == [(f"batch ({batch.prefix}…)", 1)]
    response = client.get(reverse("dashboard:usage"), {"start": "2026-03-10", "end": "2026-03-01"})
    assert "groups" not in response.context and response.context["period_form"].errors["end"]
