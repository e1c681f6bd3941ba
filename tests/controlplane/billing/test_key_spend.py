"""API keys' monthly spend limits, decided where credit holds are placed: a key's spend this month
plus what its requests in flight hold never goes above its limit, other keys are unaffected, and
settlement keeps each key's monthly spend."""

import threading
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connections

from controlplane.billing.holds import HoldRefused, HoldRequest, RequestOutcome, credit_holds_place, credit_holds_settle
from controlplane.billing.models import CreditHold, KeySpend, UsageRecord
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import ApiKeyFactory, ModelFactory, PriceTierFactory, TenantFactory

db = pytest.mark.django_db

PRICE = Decimal("0.002")
NOW = datetime(2026, 5, 10, 12, 0, tzinfo=UTC)
BUDGET_REFUSED = HoldRefused(HoldRefused.KEY_BUDGET, PRICE * 3)


@pytest.fixture
def setup():
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("1"))
    model = ModelFactory(price_tier=PriceTierFactory(price_per_request=PRICE))
    return tenant, model, ApiKeyFactory(tenant=tenant, monthly_spend_limit=PRICE * 3)


def place(tenant, model, key, *request_ids, at=NOW, priced=False):
    """Holds as the gateway asks for them: `priced` gives the price, which on PostgreSQL lets a
    single request try the one-statement path first."""
    return credit_holds_place(
        requests=[HoldRequest(rid, tenant.pk, model.pk, key.pk, 1, PRICE if priced else None) for rid in request_ids],
        at=at,
        expires_at=at + timedelta(minutes=11),
    )


def settle(*request_ids, status=UsageRecord.Status.COMPLETED, at=NOW):
    return credit_holds_settle(
        outcomes=[RequestOutcome(rid, status, total_latency_ms=10) for rid in request_ids], at=at
    )


def spent(key, month=date(2026, 5, 1)) -> Decimal:
    return KeySpend.objects.filter(api_key=key, month=month).values_list("spent", flat=True).first() or Decimal(0)


@db
def test_a_limited_key_is_refused_once_its_spend_and_holds_reach_the_limit(setup):
    tenant, model, key = setup
    holds = place(tenant, model, key, "a", "b", "c", "d")
    assert [isinstance(h, CreditHold) for h in holds] == [True, True, True, False]
    assert holds[3] == BUDGET_REFUSED
    settle("a", "b")
    assert spent(key) == PRICE * 2
    # Spent and held still fill the budget; a request released unbilled gives its share back.
    assert place(tenant, model, key, "e", priced=True) == [BUDGET_REFUSED]
    settle("c", status=None)
    assert isinstance(place(tenant, model, key, "f", priced=True)[0], CreditHold)
    assert place(tenant, model, key, "g", priced=True) == [BUDGET_REFUSED]


@db
def test_another_key_of_the_tenant_is_not_limited_and_its_spend_is_counted(setup):
    tenant, model, key = setup
    other = ApiKeyFactory(tenant=tenant)
    place(tenant, model, key, "a", "b", "c")
    assert all(isinstance(h, CreditHold) for h in place(tenant, model, other, *[f"o{i}" for i in range(5)]))
    settle("a", "b", "c", *[f"o{i}" for i in range(5)])
    assert (spent(key), spent(other)) == (PRICE * 3, PRICE * 5)
    # A limit set in the middle of the month counts what the key already spent this month.
    other.monthly_spend_limit = PRICE * 6
    other.save()
    assert [isinstance(h, CreditHold) for h in place(tenant, model, other, "o5", "o6", priced=True)] == [True, False]


@db
def test_failed_requests_do_not_count_and_a_new_month_starts_from_zero(setup):
    tenant, model, key = setup
    place(tenant, model, key, "a", "b", "c")
    settle("a", "b", "c", status=UsageRecord.Status.FAILED)  # recorded free
    assert spent(key) == 0
    assert all(isinstance(h, CreditHold) for h in place(tenant, model, key, "d", "e", "f"))
    settle("d", "e", "f")
    assert place(tenant, model, key, "g") == [BUDGET_REFUSED]
    june = datetime(2026, 6, 1, 0, 0, 1, tzinfo=UTC)
    assert isinstance(place(tenant, model, key, "h", at=june, priced=True)[0], CreditHold)
    settle("h", at=june)
    assert (spent(key), spent(key, date(2026, 6, 1))) == (PRICE * 3, PRICE)


@db
def test_the_tenants_credit_is_checked_before_the_keys_limit(setup):
    _, model, _ = setup
    poor = TenantFactory()
    credit_grant(tenant=poor, amount=PRICE)
    key = ApiKeyFactory(tenant=poor, monthly_spend_limit=PRICE * 3)
    holds = place(poor, model, key, "a", "b")
    assert isinstance(holds[0], CreditHold) and holds[1] == HoldRefused(HoldRefused.CREDIT)
    key.monthly_spend_limit = Decimal("0")  # nothing at all: even the held request is over it
    key.save()
    settle("a", status=None)
    assert place(poor, model, key, "c") == [HoldRefused(HoldRefused.KEY_BUDGET, Decimal("0"))]


@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_at_the_limit_never_exceed_it(require_postgres, setup):
    """Twenty threads at once, each placing and settling one request of the limited key (a budget
    for three) and one of an unlimited key of the same tenant: exactly three of the first are
    held and charged, all twenty of the second."""
    tenant, model, key = setup
    other = ApiKeyFactory(tenant=tenant)
    start = threading.Barrier(20)
    outcomes: list[tuple[bool, bool]] = []

    def one(i):
        try:
            start.wait()
            held = []
            for which in (key, other):
                (hold,) = place(tenant, model, which, f"{which.pk}-{i}", priced=True)
                if isinstance(hold, CreditHold):
                    settle(f"{which.pk}-{i}")
                held.append(isinstance(hold, CreditHold))
            outcomes.append(tuple(held))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(outcomes) == 20
    assert [limited for limited, _ in outcomes].count(True) == 3 and all(free for _, free in outcomes)
    assert spent(key) == PRICE * 3 and spent(other) == PRICE * 20
    assert UsageRecord.objects.filter(api_key=key).count() == 3
