"""Credit holds: placed at admission within the available credit, settled exactly once into a
charge, a free record or a release, and swept when their gateway died."""

import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connections

from controlplane.billing.holds import (
    HoldRefused,
    HoldRequest,
    RequestOutcome,
    credit_holds_expire,
    credit_holds_place,
    credit_holds_settle,
)
from controlplane.billing.models import CreditAccount, CreditEntry, CreditHold, UsageRecord
from controlplane.billing.selectors import credit_available, credit_balance
from controlplane.billing.services import InsufficientCredit, credit_debit, credit_grant
from tests.controlplane.factories import (
    ApiKeyFactory,
    ModelFactory,
    PlanFactory,
    PriceTierFactory,
    ReplicaFactory,
    TenantFactory,
    usage_record_settled,
)

db = pytest.mark.django_db

NOW = datetime(2026, 5, 10, 12, 0, tzinfo=UTC)
LATER = NOW + timedelta(minutes=11)


@pytest.fixture
def setup():
    tenant = TenantFactory()
    model = ModelFactory(price_tier=PriceTierFactory(price_per_request=Decimal("0.002")))
    return tenant, model, ApiKeyFactory(tenant=tenant)


def place(tenant, model, key, *request_ids, n=1, at=NOW):
    return credit_holds_place(
        requests=[HoldRequest(rid, tenant.pk, model.pk, key.pk, n) for rid in request_ids],
        at=at,
        expires_at=at + timedelta(minutes=11),
    )


def done(request_id, status="completed", **fields):
    return RequestOutcome(
        request_id,
        status,
        **{
            "prompt_tokens": 10,
            "completion_tokens": 5,
            "time_to_first_token_ms": 20,
            "total_latency_ms": 50,
            "gpu_time_s": 0.01,
            **fields,
        },
    )


@db
def test_holds_are_placed_while_the_available_credit_covers_them(setup):
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("0.005"))
    holds = place(tenant, model, key, "a", "b", "c")
    assert [isinstance(h, CreditHold) for h in holds] == [True, True, False]
    assert holds[2] == HoldRefused(HoldRefused.CREDIT)
    assert credit_available(tenant=tenant) == Decimal("0.001")
    # n choices hold n requests' price; what is held is not available to the next request either.
    assert place(tenant, model, key, "d", n=2) == [HoldRefused(HoldRefused.CREDIT)]
    assert credit_balance(tenant=tenant) == Decimal("0.005")  # nothing is charged by holding


@db
def test_settling_charges_records_or_releases_each_hold_once(setup):
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("1"))
    place(tenant, model, key, "ok", "cut", "broke", "refused")
    results = credit_holds_settle(
        outcomes=[done("ok"), done("cut", "cancelled"), done("broke", "failed"), RequestOutcome("refused", None)],
        at=NOW,
    )
    assert [r.found for r in results] == [True] * 4 and results[3].record is None
    records = {r.request_id: r for r in UsageRecord.objects.all()}
    assert {rid: (r.status, r.price_charged) for rid, r in records.items()} == {
        "ok": ("completed", Decimal("0.002")),
        "cut": ("cancelled", Decimal("0.002")),
        "broke": ("failed", Decimal("0")),
    }
    assert records["ok"].gpu_time_s == 0.01 and records["ok"].api_key == key
    assert records["ok"].reference_price == Decimal("0.000008")  # 15 tokens at 0.50 per million
    assert credit_balance(tenant=tenant) == Decimal("0.996") == CreditAccount.objects.get(tenant=tenant).balance
    assert not CreditHold.objects.exists() and credit_available(tenant=tenant) == Decimal("0.996")
    again = credit_holds_settle(outcomes=[done("ok")], at=NOW)
    assert not again[0].found and UsageRecord.objects.count() == 3
    assert CreditEntry.objects.filter(kind="usage").count() == 2


@db
@pytest.mark.parametrize(("prompt_tokens", "reference"), [(1, "0"), (3, "0.000002")])
def test_settlement_rounds_reference_price_ties_half_even(setup, prompt_tokens, reference):
    """One and three tokens at 0.50 per million are ties (0.5 and 1.5 micro): what the record
    holds is billing.pricing's half-even rounding, not half-up."""
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("1"))
    place(tenant, model, key, "tie")
    (settled,) = credit_holds_settle(outcomes=[done("tie", prompt_tokens=prompt_tokens, completion_tokens=0)], at=NOW)
    assert UsageRecord.objects.get(pk=settled.record.pk).reference_price == Decimal(reference)


@db
def test_the_monthly_allowance_pays_first_and_comes_back_when_not_billed(setup):
    tenant, model, key = setup
    tenant.plan = PlanFactory(included_requests_per_month=3)
    tenant.save()
    holds = place(tenant, model, key, "a", "b", n=2)  # no credit at all: only the allowance
    assert holds[0].amount == Decimal("0") and holds[0].included_requests == 2
    assert holds[1] == HoldRefused(HoldRefused.CREDIT)  # one included request left, two asked for
    credit_holds_settle(outcomes=[RequestOutcome("a", None)], at=NOW)  # never served
    assert place(tenant, model, key, "c", n=3)[0].amount == Decimal("0")
    next_month = datetime(2026, 6, 1, tzinfo=UTC)
    assert place(tenant, model, key, "d", n=3, at=next_month)[0].amount == Decimal("0")


@db
def test_usage_is_charged_the_flat_price_whatever_the_prompt_length():
    tier = PriceTierFactory(price_per_request=Decimal("0.002"), reference_price_per_million_tokens=Decimal("0.50"))
    model, tenant = ModelFactory(price_tier=tier), TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("1"))
    short = usage_record_settled(tenant=tenant, model=model, prompt_tokens=10, completion_tokens=5, at=NOW)
    long = usage_record_settled(tenant=tenant, model=model, prompt_tokens=100_000, completion_tokens=2_000, at=NOW)
    assert short.price_charged == long.price_charged == Decimal("0.002")
    assert short.reference_price == Decimal("0.000008")  # 15 tokens at 0.50 per million, rounded
    assert long.reference_price == Decimal("0.051")
    assert credit_balance(tenant=tenant) == Decimal("0.996")
    assert short.credit_entry.amount == Decimal("-0.002")


@db
def test_each_month_has_its_own_allowance_including_a_backfilled_one():
    tenant = TenantFactory(plan=PlanFactory(included_requests_per_month=2))
    model = ModelFactory()
    price = model.price_tier.price_per_request
    credit_grant(tenant=tenant, amount=price)
    first, second, third = (usage_record_settled(tenant=tenant, model=model, at=NOW) for _ in range(3))
    # Dated in an earlier month than the one the account counts: that month's allowance pays.
    last_month = usage_record_settled(tenant=tenant, model=model, at=NOW - timedelta(days=20))
    assert last_month.price_charged == first.price_charged == second.price_charged == Decimal("0")
    assert third.price_charged == price
    assert CreditEntry.objects.filter(kind=CreditEntry.Kind.USAGE).count() == 1
    assert credit_balance(tenant=tenant) == Decimal("0")


@db
def test_failed_requests_are_free_and_do_not_use_the_allowance():
    tenant = TenantFactory(plan=PlanFactory(included_requests_per_month=1))
    model = ModelFactory()
    failed = usage_record_settled(
        tenant=tenant, model=model, status=UsageRecord.Status.FAILED, time_to_first_token_ms=None, at=NOW
    )
    included = usage_record_settled(tenant=tenant, model=model, at=NOW)
    assert failed.price_charged == included.price_charged == Decimal("0")
    assert not CreditEntry.objects.exists()


@db
def test_usage_links_key_and_replica():
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("1"))
    key, replica = ApiKeyFactory(tenant=tenant), ReplicaFactory()
    record = usage_record_settled(tenant=tenant, model=replica.deployment.model, api_key=key, replica=replica)
    assert (record.api_key, record.replica) == (key, replica)


@db
def test_garbage_figures_in_an_outcome_are_recorded_within_bounds(setup):
    """What a worker reported is recorded, never refused: the request was served either way."""
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("1"))
    place(tenant, model, key, "odd")
    credit_holds_settle(
        outcomes=[
            done(
                "odd",
                prompt_tokens=-1,
                completion_tokens=-5,
                time_to_first_token_ms=2_000,
                total_latency_ms=1_000,
                gpu_time_s=-0.5,
            )
        ],
        at=NOW,
    )
    record = UsageRecord.objects.get(request_id="odd")
    assert (record.prompt_tokens, record.completion_tokens, record.gpu_time_s) == (0, 0, 0.0)
    assert (record.time_to_first_token_ms, record.total_latency_ms) == (1_000, 1_000)
    assert record.price_charged == Decimal("0.002")


@db
def test_debits_cannot_spend_held_credit(setup):
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("0.010"))
    place(tenant, model, key, "a", n=3)
    with pytest.raises(InsufficientCredit):
        credit_debit(tenant=tenant, amount=Decimal("0.005"))
    credit_debit(tenant=tenant, amount=Decimal("0.004"))
    credit_holds_settle(outcomes=[done("a")], at=NOW)
    assert credit_balance(tenant=tenant) == Decimal("0") == CreditAccount.objects.get(tenant=tenant).balance


@db
def test_an_account_starts_from_the_ledger_it_did_not_see(setup):
    tenant, model, key = setup
    CreditEntry.objects.create(tenant=tenant, kind="grant", amount=Decimal("0.003"))  # before accounts
    assert [isinstance(h, CreditHold) for h in place(tenant, model, key, "a", "b")] == [True, False]
    assert CreditAccount.objects.get(tenant=tenant).balance == Decimal("0.003")


@db
def test_expired_holds_are_charged_if_started_and_released_otherwise(setup):
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("1"))
    place(tenant, model, key, "started", "not-started")
    place(tenant, model, key, "live", at=LATER)
    assert credit_holds_expire(now=NOW + timedelta(minutes=5), started=lambda ids: ids) == []
    settled = credit_holds_expire(now=LATER + timedelta(seconds=1), started=lambda ids: {"started"} & set(ids))
    assert sorted(s.request_id for s in settled) == ["not-started", "started"]
    assert list(UsageRecord.objects.values_list("request_id", "status", "price_charged")) == [
        ("started", "cancelled", Decimal("0.002"))
    ]
    assert list(CreditHold.objects.values_list("request_id", flat=True)) == ["live"]
    assert credit_balance(tenant=tenant) == Decimal("0.998")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("durable", [True, False])
def test_concurrent_holds_never_exceed_the_credit(require_postgres, setup, durable):
    """Twenty threads, each placing and settling its own request against credit for seven."""
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("0.014"))
    start = threading.Barrier(20)
    outcomes: list[bool] = []

    def one(i):
        try:
            start.wait()
            (hold,) = place(tenant, model, key, f"r{i}")
            if isinstance(hold, CreditHold):
                credit_holds_settle(outcomes=[done(f"r{i}")], at=NOW, durable=durable)
            outcomes.append(isinstance(hold, CreditHold))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert outcomes.count(True) == 7 and len(outcomes) == 20
    assert credit_balance(tenant=tenant) == Decimal("0") == CreditAccount.objects.get(tenant=tenant).balance
    assert UsageRecord.objects.filter(price_charged__gt=0).count() == 7


@db
def test_a_single_priced_request_is_held_in_one_statement_or_by_the_locked_path(setup):
    """With the price given (the gateway's case) one request takes the one-statement path on
    PostgreSQL; whatever it cannot decide (no credit, an allowance to use) the locked path does."""
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("0.004"))

    def one(rid, n=1):
        return credit_holds_place(
            requests=[HoldRequest(rid, tenant.pk, model.pk, key.pk, n, Decimal("0.002"))], at=NOW, expires_at=LATER
        )[0]

    assert one("a").amount == Decimal("0.002") and one("b").amount == Decimal("0.002")
    assert one("c") == HoldRefused(HoldRefused.CREDIT)
    assert CreditAccount.objects.get(tenant=tenant).held == Decimal("0.004")
    assert sorted(CreditHold.objects.values_list("request_id", "amount")) == [
        ("a", Decimal("0.002")),
        ("b", Decimal("0.002")),
    ]
    tenant.plan = PlanFactory(included_requests_per_month=1)
    tenant.save()
    hold = one("d", n=2)  # one included request left, and no credit left for a paid one
    assert hold == HoldRefused(HoldRefused.CREDIT)
    assert one("e").amount == Decimal("0") and one("f") == HoldRefused(HoldRefused.CREDIT)


def _others_wait_for_locks(conn) -> bool:
    conn.execute("SELECT pg_stat_clear_snapshot()")  # the statistics are otherwise frozen per transaction
    return (
        conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        ).fetchone()[0]
        > 0
    )


@pytest.mark.django_db(transaction=True)
def test_settlement_locks_accounts_in_tenant_order_as_placement_does(require_postgres):
    """Found by the chaos run (bench/chaos.py): a batch settling a later tenant's request before
    an earlier tenant's locked their accounts in that order, while placement locks in tenant-id
    order, and the two deadlocked. Here another transaction locks the first account as placement
    does, the settlement of [second's, first's] waits for it, and that transaction then locks
    the second account: it must get it (the settlement holds no account while it waits)."""
    import psycopg
    from django.db import connection

    model = ModelFactory(price_tier=PriceTierFactory(price_per_request=Decimal("0.002")))
    first, second = sorted((TenantFactory(), TenantFactory()), key=lambda t: t.pk)
    for tenant, request_id in ((first, "first"), (second, "second")):
        credit_grant(tenant=tenant, amount=Decimal("1"))
        place(tenant, model, ApiKeyFactory(tenant=tenant), request_id)
    db = connection.settings_dict
    placement = psycopg.connect(
        dbname=db["NAME"],
        user=db["USER"],
        password=db["PASSWORD"] or None,
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
    )
    lock = "SELECT 1 FROM billing_creditaccount WHERE tenant_id = %s FOR UPDATE"
    failures: list[BaseException] = []

    def settle():
        try:
            credit_holds_settle(outcomes=[done("second"), done("first")], at=NOW)
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    try:
        placement.execute(lock, [first.pk])
        settling = threading.Thread(target=settle)
        settling.start()
        deadline = time.monotonic() + 30
        while not _others_wait_for_locks(placement):
            assert time.monotonic() < deadline, "the settlement never waited for the first account"
            time.sleep(0.05)
        placement.execute(lock, [second.pk])  # a deadlock error here without the fix
        placement.commit()
        settling.join(timeout=30)
    finally:
        placement.close()
    assert not failures
    assert credit_balance(tenant=first) == credit_balance(tenant=second) == Decimal("0.998")


@db
def test_a_failed_requests_record_keeps_its_error_code(setup):
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("1"))
    place(tenant, model, key, "broke", "ok")
    credit_holds_settle(
        outcomes=[done("broke", "failed", error_code="replica_unavailable"), done("ok", error_code="ignored")], at=NOW
    )
    assert dict(UsageRecord.objects.values_list("request_id", "error_code")) == {
        "broke": "replica_unavailable",
        "ok": "",
    }


@db
def test_the_usage_record_keeps_the_requests_image_count(setup):
    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("1"))
    place(tenant, model, key, "seen", "text")
    credit_holds_settle(outcomes=[done("seen", image_count=3), done("text")], at=NOW)
    counts = dict(UsageRecord.objects.values_list("request_id", "image_count"))
    assert counts == {"seen": 3, "text": 0}


@db
def test_the_usage_record_keeps_the_prompt_tokens_served_from_the_prefix_cache(setup):
    from controlplane.billing.holds import usage_cached_tokens

    tenant, model, key = setup
    credit_grant(tenant=tenant, amount=Decimal("1"))
    place(tenant, model, key, "hit", "odd", "miss")
    outcomes = [
        done("hit", prompt_tokens=100, cached_prompt_tokens=64),
        done("odd", prompt_tokens=10, cached_prompt_tokens=64),  # never more than the prompt
        done("miss", prompt_tokens=10),
    ]
    credit_holds_settle(outcomes=outcomes, at=NOW)
    cached = dict(UsageRecord.objects.values_list("request_id", "cached_prompt_tokens"))
    assert cached == {"hit": 64, "odd": 10, "miss": 0}
    # What a replica's usage says, read leniently: the request was served either way.
    assert usage_cached_tokens({"prompt_tokens_details": {"cached_tokens": 48}}) == 48
    for usage in ({}, {"prompt_tokens_details": None}, {"prompt_tokens_details": {"cached_tokens": "9"}}):
        assert usage_cached_tokens(usage) == 0
    assert usage_cached_tokens({"prompt_tokens_details": {"cached_tokens": -3}}) == 0
    assert usage_cached_tokens({"prompt_tokens_details": {"cached_tokens": True}}) == 0
