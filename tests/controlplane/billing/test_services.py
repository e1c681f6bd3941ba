import threading
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.extra.django import TestCase as HypothesisTestCase

from controlplane.billing.models import AppendOnlyError, CreditEntry, Plan, PriceTier
from controlplane.billing.selectors import credit_balance
from controlplane.billing.services import (
    InsufficientCredit,
    credit_debit,
    credit_grant,
    plan_create,
    price_tier_create,
)
from tests.controlplane.factories import TenantFactory

db = pytest.mark.django_db


# --- price tiers and plans -----------------------------------------------------------------


@db
def test_price_tier_and_plan_create():
    tier = price_tier_create(
        name="standard", price_per_request=Decimal("0.002"), reference_price_per_million_tokens=Decimal("0.5")
    )
    plan = plan_create(name="Pro", included_requests_per_month=10_000, rate_limit_per_minute=600)
    assert PriceTier.objects.get(pk=tier.pk).price_per_request == Decimal("0.002")
    assert Plan.objects.get(pk=plan.pk).rate_limit_per_minute == 600


@db
@pytest.mark.parametrize("price", [Decimal("-0.01"), Decimal("0.0000001")])
def test_bad_prices_raise_and_write_nothing(price):
    with pytest.raises(ValidationError) as error:
        price_tier_create(name="t", price_per_request=price, reference_price_per_million_tokens=Decimal("1"))
    assert "price_per_request" in error.value.message_dict
    assert not PriceTier.objects.exists()


@db
def test_plan_rate_limit_must_be_positive():
    with pytest.raises(ValidationError) as error:
        plan_create(name="p", included_requests_per_month=0, rate_limit_per_minute=0)
    assert "rate_limit_per_minute" in error.value.message_dict


@db
@pytest.mark.parametrize("weight", [0, 1001])
def test_plan_fair_share_weight_is_refused_outside_1_to_1000(weight):
    with pytest.raises(ValidationError) as error:
        plan_create(name="p", included_requests_per_month=0, rate_limit_per_minute=60, fair_share_weight=weight)
    assert "fair_share_weight" in error.value.message_dict
    assert not Plan.objects.exists()


@db
def test_a_tenant_s_fair_share_weight_is_its_plan_s_or_1_without_a_plan():
    from controlplane.billing.selectors import tenant_fair_share_weight

    plan = plan_create(name="Pro", included_requests_per_month=0, rate_limit_per_minute=60, fair_share_weight=4)
    assert Plan.objects.get(pk=plan.pk).fair_share_weight == 4
    assert tenant_fair_share_weight(tenant_id=TenantFactory(plan=plan).pk) == 4
    assert tenant_fair_share_weight(tenant_id=TenantFactory(plan=None).pk) == 1
    assert plan_create(name="Free", included_requests_per_month=0, rate_limit_per_minute=60).fair_share_weight == 1


# --- the ledger ---------------------------------------------------------------------------


@db
def test_balance_is_the_sum_of_entries():
    tenant = TenantFactory()
    assert credit_balance(tenant=tenant) == Decimal("0")
    credit_grant(tenant=tenant, amount=Decimal("10.00"), memo="top-up")
    credit_debit(tenant=tenant, amount=Decimal("2.50"), memo="manual")
    credit_grant(tenant=tenant, amount=Decimal("0.000001"))
    amounts = list(CreditEntry.objects.filter(tenant=tenant).values_list("amount", flat=True))
    assert sorted(amounts) == [Decimal("-2.5"), Decimal("0.000001"), Decimal("10")]
    assert credit_balance(tenant=tenant) == sum(amounts) == Decimal("7.500001")
    assert credit_balance(tenant=TenantFactory()) == Decimal("0")  # balances are per tenant


@db
def test_debit_beyond_the_balance_raises_and_writes_nothing():
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("1.00"))
    with pytest.raises(InsufficientCredit) as error:
        credit_debit(tenant=tenant, amount=Decimal("1.000001"))
    assert "amount" in error.value.message_dict
    assert CreditEntry.objects.filter(tenant=tenant).count() == 1
    credit_debit(tenant=tenant, amount=Decimal("1.00"))
    assert credit_balance(tenant=tenant) == Decimal("0")


@db
@pytest.mark.parametrize("service", [credit_grant, credit_debit])
@pytest.mark.parametrize("amount", [Decimal("0"), Decimal("-1"), Decimal("NaN"), Decimal("Infinity"), 1.5, 2, "3"])
def test_amounts_must_be_positive_decimals(service, amount):
    tenant = TenantFactory()
    with pytest.raises(ValidationError) as error:
        service(tenant=tenant, amount=amount)
    assert "amount" in error.value.message_dict
    assert not CreditEntry.objects.exists()


@db
def test_amounts_finer_than_a_micro_unit_raise():
    with pytest.raises(ValidationError) as error:
        credit_grant(tenant=TenantFactory(), amount=Decimal("0.0000001"))
    assert "amount" in error.value.message_dict


@db
def test_entries_cannot_be_changed_or_removed_through_the_orm():
    tenant = TenantFactory()
    entry = credit_grant(tenant=tenant, amount=Decimal("5"))
    entry.amount = Decimal("500")
    with pytest.raises(AppendOnlyError):
        entry.save()
    with pytest.raises(AppendOnlyError):
        entry.delete()
    with pytest.raises(AppendOnlyError):
        CreditEntry.objects.filter(tenant=tenant).update(amount=Decimal("500"))
    with pytest.raises(AppendOnlyError):
        CreditEntry.objects.filter(tenant=tenant).delete()
    assert credit_balance(tenant=tenant) == Decimal("5")


@db
@pytest.mark.parametrize(
    "statement", ["UPDATE billing_creditentry SET amount = 500", "DELETE FROM billing_creditentry"]
)
def test_postgresql_refuses_raw_updates_and_deletes_of_entries(require_postgres, statement):
    from django.db import DatabaseError, transaction

    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("5"))
    with pytest.raises(DatabaseError, match="append-only"):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement)
    assert credit_balance(tenant=tenant) == Decimal("5")


class TestLedgerProperty(HypothesisTestCase):
    """For any sequence of grants and debits, the balance is the sum of the entries written and
    never negative, and exactly the debits that fit were accepted."""

    @hypothesis_settings(max_examples=25, deadline=None)
    @given(
        st.lists(
            st.tuples(st.booleans(), st.decimals(min_value=Decimal("0.000001"), max_value=Decimal("100"), places=6)),
            max_size=12,
        )
    )
    def test_balance_invariant(self, operations):
        tenant = TenantFactory()
        expected = Decimal("0")
        for is_grant, amount in operations:
            if is_grant:
                credit_grant(tenant=tenant, amount=amount)
                expected += amount
            elif amount <= expected:
                credit_debit(tenant=tenant, amount=amount)
                expected -= amount
            else:
                with pytest.raises(InsufficientCredit):
                    credit_debit(tenant=tenant, amount=amount)
            balance = credit_balance(tenant=tenant)
            assert balance == expected >= 0
        entries = CreditEntry.objects.filter(tenant=tenant).values_list("amount", flat=True)
        assert sum(entries, Decimal("0")) == credit_balance(tenant=tenant)


@pytest.mark.django_db(transaction=True)
def test_concurrent_debits_never_overdraw(require_postgres):
    """Twelve threads debit 1.00 each from a balance of 5.00 at the same moment: the row lock
    serialises them, so exactly five succeed and the balance ends at zero, not below."""
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("5.00"))
    threads_count = 12
    start = threading.Barrier(threads_count)
    outcomes: list[str] = []
    lock = threading.Lock()

    def debit():
        try:
            start.wait()
            try:
                credit_debit(tenant=tenant, amount=Decimal("1.00"), memo="race")
                outcome = "ok"
            except InsufficientCredit:
                outcome = "refused"
            with lock:
                outcomes.append(outcome)
        finally:
            connections.close_all()  # each thread has its own connection; leave none open

    threads = [threading.Thread(target=debit) for _ in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["ok"] * 5 + ["refused"] * 7
    assert credit_balance(tenant=tenant) == Decimal("0")
    assert CreditEntry.objects.filter(tenant=tenant, kind=CreditEntry.Kind.DEBIT).count() == 5


@db
def test_a_grant_is_audited_with_who_gave_it_and_why():
    from controlplane.accounts.models import User
    from controlplane.audit.models import AuditEntry
    from tests.controlplane.factories import UserFactory

    admin = UserFactory(username="root", role=User.Role.ADMIN, tenant=None)
    tenant = TenantFactory(name="Acme")
    credit_grant(tenant=tenant, amount=Decimal("2.50"), memo="Welcome", created_by=admin)
    entry = AuditEntry.objects.get(action=AuditEntry.Action.CREDIT_GRANT)
    assert (entry.actor_label, entry.target_type, entry.target_label) == ("root", "accounts.tenant", "Acme")
    assert entry.detail == {"amount": "2.50", "note": "Welcome", "balance": "2.500000"}
    # A refused grant leaves neither a ledger entry nor an audit entry.
    with pytest.raises(ValidationError):
        credit_grant(tenant=tenant, amount=Decimal("0.0000001"), created_by=admin)
    assert AuditEntry.objects.filter(action=AuditEntry.Action.CREDIT_GRANT).count() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_grants_and_charges_add_up_exactly(require_postgres):
    """Grants arriving together with debits for one tenant: every one lands, and the balance is the
    exact sum of the ledger, to the millionth, in the account row and by the ledger alike."""
    from controlplane.billing.models import CreditAccount

    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("1.000001"))
    grants = [Decimal("0.100001") * (n + 1) for n in range(10)]
    start = threading.Barrier(len(grants) + 5)
    errors: list[BaseException] = []

    def run(action):
        try:
            start.wait()
            action()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connections.close_all()

    actions = [lambda amount=amount: credit_grant(tenant=tenant, amount=amount, memo="race") for amount in grants]
    actions += [lambda: credit_debit(tenant=tenant, amount=Decimal("0.000003"), memo="race")] * 5
    threads = [threading.Thread(target=run, args=(action,)) for action in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    expected = Decimal("1.000001") + sum(grants) - 5 * Decimal("0.000003")
    assert credit_balance(tenant=tenant) == expected == CreditAccount.objects.get(tenant=tenant).balance
