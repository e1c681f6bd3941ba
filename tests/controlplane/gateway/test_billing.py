"""Per-request billing through the running gateway: exact under concurrency, idempotent replays,
the plan's allowance, and holds left behind by a gateway that died mid-request."""

import time
from datetime import timedelta
from decimal import Decimal

import openai
import pytest
import redis
from django.db.models import Sum
from django.utils import timezone

from controlplane.billing.holds import HoldRequest, credit_holds_place
from controlplane.billing.models import CreditAccount, CreditEntry, CreditHold, UsageRecord
from controlplane.billing.selectors import credit_balance
from tests.controlplane.gateway.conftest import make_world

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "hi"}]


def test_200_concurrent_requests_with_credit_for_50(gateway, replicas, require_postgres):
    """Exactly 50 are served and billed, 150 refused for quota; the balance ends at zero and the
    ledger equals the usage records."""
    world = make_world(gateway, replicas, credit=Decimal("0.100"), price=Decimal("0.002"))
    outcomes = world.chats_at_once(200)
    assert outcomes.count("served") == 50 and outcomes.count("insufficient_quota") == 150
    world.settled()
    assert credit_balance(tenant=world.tenant) == Decimal("0")
    records = UsageRecord.objects.filter(tenant=world.tenant)
    assert records.count() == 50 and all(r.price_charged == Decimal("0.002") for r in records)
    usage_entries = CreditEntry.objects.filter(tenant=world.tenant, kind=CreditEntry.Kind.USAGE)
    assert (
        -usage_entries.aggregate(total=Sum("amount"))["total"] == records.aggregate(total=Sum("price_charged"))["total"]
    )
    assert set(usage_entries.values_list("usage_record_id", flat=True)) == set(records.values_list("pk", flat=True))
    account = CreditAccount.objects.get(tenant=world.tenant)
    assert (account.balance, account.held) == (Decimal("0"), Decimal("0"))
    assert not CreditHold.objects.exists()


def test_idempotency_key_replays_a_completed_request(gateway, replicas):
    world = make_world(gateway, replicas)
    client = world.client()
    ask = dict(model=world.model.public_name, messages=CHAT, max_tokens=3, temperature=1.0)
    first = client.chat.completions.with_raw_response.create(**ask, extra_headers={"Idempotency-Key": "order-1"})
    again = client.chat.completions.with_raw_response.create(**ask, extra_headers={"Idempotency-Key": "order-1"})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.parse().model_dump() == first.parse().model_dump()
    world.settled()
    assert UsageRecord.objects.count() == 1 and credit_balance(tenant=world.tenant) == Decimal("9.998")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{**ask, "max_tokens": 4}, extra_headers={"Idempotency-Key": "order-1"})
    assert error.value.code == "idempotency_key_reused"
    other = client.chat.completions.with_raw_response.create(**ask, extra_headers={"Idempotency-Key": "order-2"})
    assert "idempotent-replayed" not in other.headers
    world.settled()
    assert UsageRecord.objects.count() == 2


def test_a_failed_request_leaves_its_idempotency_key_free(gateway, replicas):
    world = make_world(gateway, replicas, credit=Decimal("0"))
    client = world.client()
    ask = dict(model=world.model.public_name, messages=CHAT, max_tokens=2, extra_headers={"Idempotency-Key": "k"})
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**ask)
    from controlplane.billing.services import credit_grant

    credit_grant(tenant=world.tenant, amount=Decimal("1"))
    assert client.chat.completions.create(**ask).choices


def test_the_plans_monthly_allowance_is_used_first(gateway, replicas):
    from tests.controlplane.factories import PlanFactory

    plan = PlanFactory(included_requests_per_month=3, rate_limit_per_minute=1000, max_concurrent_requests=50)
    world = make_world(gateway, replicas, credit=Decimal("1"), plan=plan)
    client = world.client()
    costs = [
        client.chat.completions.create(
            model=world.model.public_name, messages=CHAT, max_tokens=1, n=2
        ).usage.model_extra["cost"]
        for _ in range(3)
    ]
    # Three included requests: two for the first call's two choices, one for the second's first.
    assert costs == [0.0, 0.002, 0.004]
    world.settled()
    assert credit_balance(tenant=world.tenant) == Decimal("0.994")


def test_holds_of_a_dead_gateway_are_charged_if_started_and_released_otherwise(gateway, replicas):
    world = make_world(gateway, replicas, credit=Decimal("1"))
    past = timezone.now() - timedelta(minutes=20)
    started, unstarted = "req_crashed_after_first_token", "req_crashed_before_first_token"
    credit_holds_place(
        requests=[HoldRequest(rid, world.tenant.pk, world.model.pk, world.api_key.pk) for rid in (started, unstarted)],
        at=past,
        expires_at=past + timedelta(minutes=11),
    )
    assert CreditAccount.objects.get(tenant=world.tenant).held == Decimal("0.004")
    # What the dead gateway wrote when the first token went out.
    redis.Redis.from_url(gateway.redis_url).set(f"gw:started:{started}", 1, ex=60)
    deadline = time.monotonic() + 10  # the gateway under test sweeps every second
    while CreditHold.objects.exists():
        assert time.monotonic() < deadline, "the expired holds were never swept"
        time.sleep(0.2)
    assert list(UsageRecord.objects.values_list("request_id", "status", "price_charged")) == [
        (started, "cancelled", Decimal("0.002"))
    ]
    account = CreditAccount.objects.get(tenant=world.tenant)
    assert (account.balance, account.held) == (Decimal("0.998"), Decimal("0"))
