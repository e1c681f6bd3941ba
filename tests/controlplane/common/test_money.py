"""Money is exact on every database: a Decimal in Python, whole micro-units in the database, so that
10,000 charges add up to the micro-unit and a drained balance reads 0, on PostgreSQL (the suite's
database) and on SQLite (the embedded default, run in a process of its own)."""

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Sum
from django.test import Client
from django.urls import reverse

from controlplane.accounts.models import ApiKey, User
from controlplane.billing.holds import HoldRequest, RequestOutcome, credit_holds_place, credit_holds_settle
from controlplane.billing.key_spend import api_keys_with_spend
from controlplane.billing.models import CreditAccount, CreditEntry, CreditHold, PriceTier, UsageRecord
from controlplane.billing.reports import usage_by, usage_totals
from controlplane.billing.selectors import credit_balance, credit_balances
from controlplane.billing.services import credit_debit, credit_grant
from controlplane.common.money import MoneyField, from_micros, money_sum, to_micros
from tests.controlplane.factories import ApiKeyFactory, ModelFactory, PriceTierFactory, TenantFactory
from tests.controlplane.sqlite_process import run_on_sqlite

# Prices the tier allows (six decimal places), some of them far from round numbers in binary.
PRICES = (Decimal("0.0001"), Decimal("0.002"), Decimal("0.333333"), Decimal("0.000007"))
REFERENCE_RATE = Decimal("1.234567")  # per million tokens: 18 tokens -> 0.0000222222, held as 0.000022
REQUESTS = 10_000
AT = datetime(2026, 3, 2, 12, tzinfo=UTC)


def _expected() -> dict:
    each = REQUESTS // len(PRICES)
    total = f"{sum(PRICES) * each:.6f}"
    by_model = {f"money-{i}": f"{price * each:.6f}" for i, price in enumerate(PRICES)}
    return {
        "revenue": total,
        "reference": "0.220000",
        "by_model": by_model,
        "usage_sum": total,
        "ledger_sum": "0.000000",
        "balance": "0.000000",
        "balances": "0.000000",
        "account": ["0.000000", "0.000000"],
        "stored": ["0", "0"],
        "key_spent": total,
        "csv_revenue": by_model,
    }


def charge_and_read() -> dict:
    """Charge REQUESTS requests through the credit holds (placed at admission, settled at the end,
    as the gateway does) for a tenant granted exactly their cost plus a dollar that ledger debits
    of odd amounts then spend; read the money back every way the product reads it."""
    tenant = TenantFactory()
    key = ApiKeyFactory(tenant=tenant)
    models = [
        ModelFactory(
            public_name=f"money-{i}",
            price_tier=PriceTierFactory(price_per_request=price, reference_price_per_million_tokens=REFERENCE_RATE),
        )
        for i, price in enumerate(PRICES)
    ]
    credit_grant(tenant=tenant, amount=sum(PRICES) * (REQUESTS // len(PRICES)) + 1)
    for amount in (Decimal("0.333333"), Decimal("0.333333"), Decimal("0.333333"), Decimal("0.000001")):
        credit_debit(tenant=tenant, amount=amount)
    for start in range(0, REQUESTS, 500):
        ids = [f"money-{n}" for n in range(start, start + 500)]
        holds = credit_holds_place(
            requests=[
                HoldRequest(rid, tenant.pk, models[n % len(models)].pk, key.pk) for n, rid in enumerate(ids, start)
            ],
            at=AT,
            expires_at=AT + timedelta(minutes=10),
        )
        assert all(isinstance(hold, CreditHold) for hold in holds), holds
        credit_holds_settle(
            outcomes=[
                RequestOutcome(rid, UsageRecord.Status.COMPLETED, prompt_tokens=7, completion_tokens=11) for rid in ids
            ],
            at=AT,
        )
    since, until = AT - timedelta(days=1), AT + timedelta(days=1)
    account = CreditAccount.objects.get(tenant=tenant)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT balance, held FROM {CreditAccount._meta.db_table} WHERE tenant_id = %s", [tenant.pk])
        stored = cursor.fetchone()
    totals = usage_totals(since=since, until=until, tenant=tenant)
    return {
        "revenue": str(totals.revenue),
        "reference": str(totals.reference),
        "by_model": {row.key: str(row.revenue) for row in usage_by(group_by="model", since=since, until=until)},
        "usage_sum": str(UsageRecord.objects.aggregate(total=Sum("price_charged"))["total"]),
        "ledger_sum": str(CreditEntry.objects.filter(tenant=tenant).aggregate(total=Sum("amount"))["total"]),
        "balance": str(credit_balance(tenant=tenant)),
        "balances": str(credit_balances(tenant_ids=[tenant.pk])[tenant.pk]),
        "account": [str(account.balance), str(account.held)],
        "stored": [repr(value) for value in stored],
        "key_spent": str(api_keys_with_spend(keys=ApiKey.objects.filter(pk=key.pk), at=AT).get().spent_this_month),
        "csv_revenue": _csv_revenue_by_model(),
    }


def _csv_revenue_by_model() -> dict:
    client = Client()
    client.force_login(User.objects.create(username="money-admin", role=User.Role.ADMIN))
    response = client.get(
        reverse("dashboard:reports_csv"), {"start": "2026-03-02", "end": "2026-03-02", "group_by": "model"}
    )
    assert response.status_code == 200, response.status_code
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    return {row["model"]: row["revenue"] for row in rows}


@pytest.mark.django_db
def test_ten_thousand_charges_add_up_exactly_on_postgresql(require_postgres):
    assert charge_and_read() == _expected()


@pytest.mark.slow
def test_ten_thousand_charges_add_up_exactly_on_sqlite(tmp_path):
    assert run_on_sqlite(f"{__name__}:charge_and_read", tmp_path) == _expected()


@pytest.mark.parametrize(
    ("amount", "micros"),
    [
        (Decimal("0.002"), 2000),
        (Decimal("-0.333333"), -333333),
        (Decimal("999999999999.999999"), 999999999999999999),
        (Decimal("1E+2"), 100_000_000),
        (0, 0),
        (Decimal("0.0000010"), 1),
    ],
)
def test_amounts_are_micro_units_both_ways(amount, micros):
    assert to_micros(amount) == micros
    assert from_micros(micros) == amount and from_micros(Decimal(micros)) == amount
    assert from_micros(micros).as_tuple().exponent == -6  # six places, as the decimal columns read


@pytest.mark.parametrize(
    ("amount", "error"),
    [
        (0.1, TypeError),
        (True, TypeError),
        ("0.1", TypeError),
        (Decimal("0.0000001"), ValueError),
        (Decimal("NaN"), ValueError),
        (Decimal("Infinity"), ValueError),
    ],
)
def test_what_is_not_an_exact_amount_is_refused(amount, error):
    with pytest.raises(error):
        to_micros(amount)


@pytest.mark.parametrize("micros", [1.5, 2.0, Decimal("2.5"), "2000", None])
def test_only_whole_micro_units_are_read(micros):
    with pytest.raises(TypeError, match="micro-units"):
        from_micros(micros)


@pytest.mark.django_db
def test_the_field_refuses_what_it_cannot_store_exactly():
    tier = PriceTier(name="fine", price_per_request=Decimal("0.0000001"), reference_price_per_million_tokens=0)
    with pytest.raises(ValidationError) as error:
        tier.full_clean()
    assert "price_per_request" in error.value.message_dict
    with pytest.raises(ValueError, match="price_per_request.*millionths"), transaction.atomic():
        tier.save()  # not rounded to 0 behind the caller's back
    tier.price_per_request = 0.1
    with pytest.raises(ValidationError, match="not float"):
        tier.full_clean()
    field = PriceTier._meta.get_field("price_per_request")
    assert field.to_python("0.25") == Decimal("0.25")
    with pytest.raises(ValidationError):
        field.to_python("a dollar")
    assert field.formfield().__class__.__name__ == "DecimalField" and field.formfield().decimal_places == 6


@pytest.mark.django_db
def test_lookups_and_empty_sums_are_in_dollars():
    PriceTierFactory(name="cheap", price_per_request=Decimal("0.000001"))
    PriceTierFactory(name="dear", price_per_request=Decimal("2.5"))
    assert list(PriceTier.objects.filter(price_per_request__gt=Decimal("0.000001")).values_list("name", flat=True)) == [
        "dear"
    ]
    assert PriceTier.objects.filter(price_per_request__lte="0.000001").get().name == "cheap"
    assert PriceTier.objects.get(name="dear").price_per_request == Decimal("2.500000")
    assert PriceTier.objects.filter(name="none").aggregate(total=money_sum("price_per_request"))["total"] == 0
    assert isinstance(MoneyField().formfield().clean("1.5"), Decimal)
