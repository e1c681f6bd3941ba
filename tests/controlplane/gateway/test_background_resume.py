"""A background response whose gateway process died is run again by another gateway process, from
its stored request, and charged once: whether the dead run had held its credit, had already been
charged, or had done nothing yet; and of gateway processes racing for it, one runs it."""

import os
import signal
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.billing.holds import HoldRequest, RequestOutcome, credit_holds_place, credit_holds_settle
from controlplane.billing.models import CreditAccount, CreditEntry, CreditHold, UsageRecord
from tests.controlplane.gateway.conftest import (
    background_response_finished,
    make_world,
    orphaned_background_response,
    start_gateway,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LEASE_S = 3  # the rescuing gateways' claims, so that they look for orphans every second


@pytest.fixture(scope="module")
def rescuers(gateway, database_url):
    """Two more gateway processes on the shared gateway's Redis, quick to take over orphans."""
    servers = [
        start_gateway(database_url, gateway.redis_url, GATEWAY_BACKGROUND_LEASE_SECONDS=str(LEASE_S)) for _ in range(2)
    ]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def world(gateway, replicas, rescuers):
    return make_world(gateway, replicas)


def _hold(world, request_id: str) -> None:
    """The credit hold the dead run placed at its admission."""
    now = timezone.now()
    (hold,) = credit_holds_place(
        requests=[
            HoldRequest(
                request_id=request_id,
                tenant_id=world.tenant.pk,
                model_id=world.model.pk,
                api_key_id=world.api_key.pk,
                price_per_request=world.model.price_tier.price_per_request,
            )
        ],
        at=now,
        expires_at=now + timedelta(seconds=5),  # runs out during the new run unless adopted
    )
    assert isinstance(hold, CreditHold)


def _charged_once(world, request_id: str) -> None:
    price = world.model.price_tier.price_per_request
    world.settled(15)
    (record,) = UsageRecord.objects.filter(tenant=world.tenant)
    assert record.request_id == request_id and record.status == "completed" and record.price_charged == price
    (charge,) = CreditEntry.objects.filter(tenant=world.tenant, kind="usage")
    assert charge.amount == -price
    account = CreditAccount.objects.get(tenant=world.tenant)
    assert account.held == 0


def test_an_orphan_with_nothing_held_is_run_again_and_charged_once(world):
    orphan = orphaned_background_response(world)
    done = background_response_finished(orphan.pk)
    assert done.status in ("completed", "incomplete") and done.runs == 2  # run by one rescuer
    assert done.response["output"] and 0 < done.response["usage"]["output_tokens"] <= 4
    assert done.history[-1]["type"] == "message"  # the next turn continues from its answer
    _charged_once(world, orphan.request_id)
    assert world.client().responses.retrieve(orphan.pk).status == done.status


def test_an_orphan_whose_credit_was_held_keeps_that_hold_and_is_charged_once(world):
    orphan = orphaned_background_response(world, max_output_tokens=200)
    _hold(world, orphan.request_id)
    done = background_response_finished(orphan.pk)
    assert done.status in ("completed", "incomplete") and done.runs == 2
    time.sleep(6)  # past the dead run's hold expiry: the hold sweeper (every second) found nothing to settle
    _charged_once(world, orphan.request_id)


def test_an_orphan_already_charged_is_run_again_free(world):
    orphan = orphaned_background_response(world)
    _hold(world, orphan.request_id)
    # The dead run was answered and charged, then died before it stored the answer.
    credit_holds_settle(
        outcomes=[RequestOutcome(orphan.request_id, UsageRecord.Status.COMPLETED, completion_tokens=4)],
        at=timezone.now(),
    )
    done = background_response_finished(orphan.pk)
    assert done.status in ("completed", "incomplete") and done.runs == 2
    assert done.response["usage"]["cost"] == float(world.model.price_tier.price_per_request)
    _charged_once(world, orphan.request_id)


def test_gateways_racing_for_orphans_run_each_once(world):
    orphans = [orphaned_background_response(world) for _ in range(4)]
    for orphan in orphans:
        assert background_response_finished(orphan.pk).runs == 2  # taken over once: no second process ran it too
    world.settled(15)
    assert sorted(UsageRecord.objects.filter(tenant=world.tenant).values_list("request_id", flat=True)) == sorted(
        orphan.request_id for orphan in orphans
    )
    assert CreditEntry.objects.filter(tenant=world.tenant, kind="usage").count() == len(orphans)


def test_a_response_survives_the_gateway_process_that_took_it(world, gateway, database_url):
    doomed = start_gateway(database_url, gateway.redis_url, GATEWAY_BACKGROUND_LEASE_SECONDS=str(LEASE_S))
    try:
        client = world.client()
        client.base_url = f"{doomed.url}/v1"
        queued = client.responses.create(
            model=world.model.public_name, input="Go on", max_output_tokens=200, background=True, temperature=0
        )
        wait_until(
            lambda: CreditHold.objects.filter(tenant=world.tenant).exists(), 30, "the request to be admitted and held"
        )
        os.kill(doomed.process.pid, signal.SIGKILL)
        doomed.process.wait(10)
    finally:
        doomed.stop()
    done = background_response_finished(queued.id, timeout=120)
    assert done.status in ("completed", "incomplete"), done.response
    assert done.runs == 2 and done.response["output"]  # finished by a process that did not take it
    world.settled(15)
    (record,) = UsageRecord.objects.filter(tenant=world.tenant)
    assert record.request_id == done.request_id and record.status == "completed"
    assert CreditEntry.objects.filter(tenant=world.tenant, kind="usage").count() == 1
