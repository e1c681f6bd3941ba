"""The request log: a tenant member reads their own tenant's requests, an admin every tenant's;
filters by range, key, model and outcome; pages of 50; the same rows as CSV."""

import csv
import io
import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.billing.models import Refusal
from controlplane.billing.refusals import SHED_ERROR_CODE, RefusalTally, refusals_record
from controlplane.billing.services import credit_grant
from controlplane.dashboard.request_log.views import PAGE_SIZE
from tests.controlplane.factories import (
    ApiKeyFactory,
    ModelFactory,
    PriceTierFactory,
    TenantFactory,
    UserFactory,
    usage_record_settled,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def world():
    tenant, other = TenantFactory(name="acme"), TenantFactory(name="=other")
    for who in (tenant, other):
        credit_grant(tenant=who, amount=Decimal("10"))
    chat = ModelFactory(public_name="chat-small", price_tier=PriceTierFactory(price_per_request=Decimal("0.002")))
    embed = ModelFactory(public_name="embed-small", price_tier=PriceTierFactory(price_per_request=Decimal("0.001")))
    prod, batch = ApiKeyFactory(tenant=tenant, name="production"), ApiKeyFactory(tenant=tenant, name="batch")
    now = timezone.now()
    records = {
        "ok": usage_record_settled(
            tenant=tenant,
            model=chat,
            api_key=prod,
            prompt_tokens=31,
            completion_tokens=7,
            image_count=2,
            time_to_first_token_ms=42,
            total_latency_ms=180,
            at=now - timedelta(minutes=3),
        ),
        "failed": usage_record_settled(
            tenant=tenant,
            model=chat,
            api_key=batch,
            status="failed",
            error_code="replica_unavailable",
            time_to_first_token_ms=None,
            at=now - timedelta(minutes=2),
        ),
        "gone": usage_record_settled(
            tenant=tenant, model=embed, api_key=prod, status="cancelled", at=now - timedelta(minutes=1)
        ),
        "old": usage_record_settled(tenant=tenant, model=chat, api_key=prod, at=now - timedelta(days=20)),
        "other": usage_record_settled(
            tenant=other, model=chat, api_key=ApiKeyFactory(tenant=other, name="theirs"), at=now - timedelta(minutes=4)
        ),
    }
    return tenant, other, prod, records


def _ids(response) -> list[str]:
    return [record.request_id for record in response.context["page"].object_list]


def test_a_member_sees_their_tenants_requests_of_the_last_week_with_their_figures(client, world):
    tenant, _, _, records = world
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    response = client.get(reverse("dashboard:requests"))
    assert _ids(response) == [records[k].request_id for k in ("gone", "failed", "ok")]  # newest first
    page = response.content.decode()
    row = page[page.index(f'data-request-id="{records["ok"].request_id}"') :]
    row = row[: row.index("</tr>")]
    for text in (
        "production <code>",
        "chat-small",
        'data-field="prompt_tokens">31<',
        'data-field="completion_tokens">7<',
        'data-field="images">2<',
        'data-field="ttft">42<',
        'data-field="latency">180<',
        ">ok</span>",
        'data-field="cost">$0.002<',
    ):
        assert text in row, text
    assert ">replica_unavailable</span>" in page and ">client gone</span>" in page
    assert 'data-field="cost">$0.00<' in page  # the failed request: free, not "included in plan"
    assert 'name="tenant"' not in page and "theirs" not in page


def test_filters_by_key_model_outcome_and_range(client, world):
    tenant, _, prod, records = world
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    url = reverse("dashboard:requests")
    assert _ids(client.get(url, {"key": prod.pk})) == [records["gone"].request_id, records["ok"].request_id]
    assert _ids(client.get(url, {"model": "embed-small"})) == [records["gone"].request_id]
    assert _ids(client.get(url, {"outcome": "error"})) == [records["failed"].request_id]
    assert _ids(client.get(url, {"outcome": "client_gone"})) == [records["gone"].request_id]
    old_day = records["old"].created_at.date().isoformat()
    assert _ids(client.get(url, {"start": old_day, "end": old_day})) == [records["old"].request_id]


def test_another_tenants_key_and_bad_filters_are_refused_beside_their_fields(client, world):
    tenant, other, _, _ = world
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    url = reverse("dashboard:requests")
    theirs = other.api_keys.get().pk
    response = client.get(url, {"key": theirs})
    assert "page" not in response.context and response.context["form"].errors["key"]
    response = client.get(url, {"outcome": "maybe", "start": "2026-03-10", "end": "2026-03-01"})
    assert set(response.context["form"].errors) == {"outcome", "end"}
    assert client.get(reverse("dashboard:requests_csv"), {"key": theirs}).status_code == 400


def test_an_admin_sees_every_tenant_and_filters_by_one(client, world):
    tenant, other, _, records = world
    client.force_login(UserFactory(role=User.Role.ADMIN))
    url = reverse("dashboard:requests")
    response = client.get(url)
    assert records["other"].request_id in _ids(response) and len(_ids(response)) == 4
    assert "<th>Tenant</th>" in response.content.decode()
    assert _ids(client.get(url, {"tenant": other.pk})) == [records["other"].request_id]
    # The key choices are the picked tenant's keys.
    assert [k.name for k in client.get(url, {"tenant": tenant.pk}).context["form"].fields["key"].queryset] == [
        "batch",
        "production",
    ]


def test_operators_and_anonymous_readers_are_refused(client, world):
    client.force_login(UserFactory(role=User.Role.OPERATOR))
    assert client.get(reverse("dashboard:requests")).status_code == 403
    client.logout()
    assert client.get(reverse("dashboard:requests_csv")).status_code == 302


def test_pages_of_fifty_and_the_csv_has_every_row(client, world):
    tenant, _, prod, records = world
    model = records["ok"].model
    for minute in range(PAGE_SIZE):
        usage_record_settled(
            tenant=tenant, model=model, api_key=prod, at=timezone.now() - timedelta(hours=1, minutes=minute)
        )
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    first = client.get(reverse("dashboard:requests"), {"model": "chat-small"})
    assert len(_ids(first)) == PAGE_SIZE and first.context["page"].paginator.count == PAGE_SIZE + 2
    assert 'id="requests-older"' in first.content.decode()
    second = client.get(reverse("dashboard:requests"), {"model": "chat-small", "page": 2})
    assert len(_ids(second)) == 2 and records["failed"].request_id not in _ids(second)

    response = client.get(reverse("dashboard:requests_csv"), {"model": "chat-small"})
    assert response["Content-Disposition"].startswith('attachment; filename="gpuserve-requests-')
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert len(rows) == PAGE_SIZE + 2
    ok = next(row for row in rows if row["request_id"] == records["ok"].request_id)
    assert ok == {
        **ok,
        "tenant": "acme",
        "key": "production",
        "model": "chat-small",
        "outcome": "ok",
        "prompt_tokens": "31",
        "completion_tokens": "7",
        "images": "2",
        "time_to_first_token_ms": "42",
        "total_latency_ms": "180",
        "cost": "0.002000",
    }
    failed = next(row for row in rows if row["request_id"] == records["failed"].request_id)
    assert (failed["outcome"], failed["time_to_first_token_ms"], failed["cost"]) == (
        "replica_unavailable",
        "",
        "0.000000",
    )


def test_csv_names_are_inert_for_spreadsheets(client, world):
    _, other, _, _ = world
    client.force_login(UserFactory(role=User.Role.ADMIN))
    response = client.get(reverse("dashboard:requests_csv"), {"tenant": other.pk})
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [row["tenant"] for row in rows] == ["'=other"]


def _csv_rows(response) -> list[dict]:
    return list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))


def test_the_csv_lists_refusals_after_the_served_requests_with_their_count_status_code_reason_and_endpoint(
    client, world
):
    tenant, other, prod, records = world
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    model = records["ok"].model
    chat = "/v1/chat/completions"

    def tally(tenant_id, key_id, status, code, reason, request_id, count, model_id=None, endpoint=chat):
        return RefusalTally(
            minute=minute,
            tenant_id=tenant_id,
            api_key_id=key_id,
            model_id=model_id,
            endpoint=endpoint,
            status=status,
            error_code=code,
            reason=reason,
            request_id=request_id,
            count=count,
        )

    refusals_record(
        tallies=[
            tally(tenant.pk, prod.pk, 429, "rate_limit_exceeded", "=Rate limit reached", "req_limited", 3, model.pk),
            tally(tenant.pk, prod.pk, 429, SHED_ERROR_CODE, "The model is overloaded.", "req_shed", 1, model.pk),
            tally(other.pk, None, 404, "not_found", "No batch.", "req_theirs", 2, endpoint="/v1/batches/{batch_id}"),
            tally(None, None, 401, "invalid_api_key", "Incorrect API key provided.", "req_bad_key", 7, endpoint=""),
            tally(tenant.pk, prod.pk, 400, "invalid_request", "Too old.", "req_old", 1),
        ]
    )
    Refusal.objects.filter(request_id="req_old").update(minute=minute - timedelta(days=20))
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    rows = _csv_rows(client.get(reverse("dashboard:requests_csv")))
    served = [records[k].request_id for k in ("gone", "failed", "ok")]
    assert [row["request_id"] for row in rows] == [*served, "req_shed", "req_limited"]  # each part newest first
    assert [(row["count"], row["status"], row["error_code"], row["endpoint"]) for row in rows[:3]] == [
        ("1", "", "", ""),
        ("1", "", "replica_unavailable", ""),
        ("1", "", "", ""),
    ]
    limited = rows[-1]
    assert limited == {
        "time": minute.isoformat(),
        "request_id": "req_limited",
        "tenant": "acme",
        "key": "production",
        "key_prefix": prod.prefix,
        "model": "chat-small",
        "outcome": "refused",
        "prompt_tokens": "0",
        "completion_tokens": "0",
        "images": "0",
        "time_to_first_token_ms": "",
        "total_latency_ms": "",
        "cost": "0.000000",
        "count": "3",
        "status": "429",
        "error_code": "rate_limit_exceeded",
        "reason": "'=Rate limit reached",  # inert for spreadsheets
        "endpoint": chat,
    }
    assert rows[-2]["outcome"] == "shed"

    # The page's filters apply to the refusals too.
    shed = _csv_rows(client.get(reverse("dashboard:requests_csv"), {"outcome": "shed"}))
    assert [row["request_id"] for row in shed] == ["req_shed"]
    ok = _csv_rows(client.get(reverse("dashboard:requests_csv"), {"outcome": "ok"}))
    assert [row["request_id"] for row in ok] == [records["ok"].request_id]
    embed = _csv_rows(client.get(reverse("dashboard:requests_csv"), {"model": "embed-small"}))
    assert [row["request_id"] for row in embed] == [records["gone"].request_id]

    # An admin's export of every tenant has the refusals no tenant owns (bad keys).
    client.force_login(UserFactory(role=User.Role.ADMIN))
    every = _csv_rows(client.get(reverse("dashboard:requests_csv"), {"outcome": "refused"}))
    assert {row["request_id"]: (row["tenant"], row["count"], row["endpoint"]) for row in every} == {
        "req_limited": ("acme", "3", chat),
        "req_shed": ("acme", "1", chat),
        "req_theirs": ("'=other", "2", "/v1/batches/{batch_id}"),
        "req_bad_key": ("", "7", ""),
    }
    # The page shows each tally's endpoint as the CSV gives it.
    page = client.get(reverse("dashboard:requests"), {"outcome": "refused"}).content.decode()
    shown = dict(re.findall(r'data-request-id="(req_\w+)".*?data-field="endpoint">(.*?)</td>', page, re.S))
    assert shown == {
        "req_limited": f"<code>{chat}</code>",
        "req_shed": f"<code>{chat}</code>",
        "req_theirs": "<code>/v1/batches/{batch_id}</code>",
        "req_bad_key": '<span class="muted">unknown path</span>',
    }
