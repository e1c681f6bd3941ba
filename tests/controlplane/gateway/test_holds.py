"""The gateway's hold placer: the asynchronous one-statement path and the lane's locked path
must give the same holds and the same refusals, whichever takes a request."""

import asyncio
from decimal import Decimal

import pytest
from django.db import connections

from controlplane.billing.holds import HoldRefused, HoldRequest
from controlplane.billing.models import CreditAccount, CreditHold
from controlplane.billing.services import credit_grant
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.holds import HoldPlacer
from tests.controlplane.factories import ApiKeyFactory, ModelFactory, PlanFactory, PriceTierFactory, TenantFactory

PRICE = Decimal("0.002")
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def setup(require_postgres):
    tenant = TenantFactory()
    model = ModelFactory(price_tier=PriceTierFactory(price_per_request=PRICE))
    return tenant, model, ApiKeyFactory(tenant=tenant)


def request(setup, rid: str, n: int = 1) -> HoldRequest:
    tenant, model, key = setup
    return HoldRequest(rid, tenant.pk, model.pk, key.pk, n, PRICE)


async def _with_placer(work):
    lane = DatabaseLane("admit-test")
    placer = HoldPlacer(lane, hold_lifetime_s=600)
    try:
        return await work(placer)
    finally:
        await placer.aclose()
        await asyncio.get_running_loop().run_in_executor(None, lane.close)


def test_sequential_holds_take_the_asynchronous_path_until_the_credit_runs_out(setup):
    tenant = setup[0]
    credit_grant(tenant=tenant, amount=Decimal("0.006"))

    async def work(placer):
        return [await placer.submit(request(setup, f"r{i}")) for i in range(4)]

    holds = asyncio.run(_with_placer(work))
    connections.close_all()
    assert [isinstance(hold, CreditHold) for hold in holds] == [True, True, True, False]
    assert all(hold.pk and hold.amount == PRICE for hold in holds[:3])
    assert CreditAccount.objects.get(tenant=tenant).held == Decimal("0.006")
    assert sorted(CreditHold.objects.values_list("request_id", flat=True)) == ["r0", "r1", "r2"]


def test_an_allowance_to_use_goes_to_the_locked_path(setup):
    tenant = setup[0]
    tenant.plan = PlanFactory(included_requests_per_month=1)
    tenant.save()
    credit_grant(tenant=tenant, amount=Decimal("0.002"))

    async def work(placer):
        return [await placer.submit(request(setup, f"r{i}")) for i in range(3)]

    first, second, third = asyncio.run(_with_placer(work))
    connections.close_all()
    assert first.included_requests == 1 and first.amount == 0
    assert second.amount == PRICE and third == HoldRefused(HoldRefused.CREDIT)


def test_concurrent_holds_from_both_paths_never_exceed_the_credit(setup):
    """Forty requests at once against credit for nine: one runs on the asynchronous connection
    while the rest queue on the lane; exactly nine are held."""
    tenant = setup[0]
    credit_grant(tenant=tenant, amount=PRICE * 9)

    async def work(placer):
        return await asyncio.gather(*[placer.submit(request(setup, f"r{i}")) for i in range(40)])

    holds = asyncio.run(_with_placer(work))
    connections.close_all()
    assert sum(isinstance(hold, CreditHold) for hold in holds) == 9
    account = CreditAccount.objects.get(tenant=tenant)
    assert account.held == account.balance == PRICE * 9
    assert CreditHold.objects.filter(tenant=tenant).count() == 9
