"""The margin per model: billing's revenue against the GPU-hours its requests kept busy (the engine's
per-request GPU seconds) and the GPU-hours the fleet's replicas held."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from controlplane.billing.services import credit_grant
from controlplane.dashboard.home import admin_home
from controlplane.dashboard.margins import model_margins
from controlplane.fleet.models import Replica
from tests.controlplane.factories import (
    DeploymentFactory,
    GpuFactory,
    ModelFactory,
    PriceTierFactory,
    ReplicaFactory,
    TenantFactory,
    usage_record_settled,
)

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)


def _funded_tenant():
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("100"))
    return tenant


def test_model_margins_set_revenue_against_gpu_hours_held_in_the_period():
    since, until = T0, T0 + timedelta(hours=10)
    earning = ModelFactory(public_name="earning", price_tier=PriceTierFactory(price_per_request=Decimal("1.5")))
    idle = ModelFactory(public_name="idle")
    gpu = GpuFactory()
    on_gpu = dict(worker=gpu.worker, gpu=gpu)
    # earning: 2 h stopped inside the period, 3 h of a replica placed before it and live past it
    # (only its share inside counts: the whole 10 h), and one on the CPU (no GPU held).
    deployment = DeploymentFactory(model=earning)
    _replica(
        deployment,
        created=since + timedelta(hours=1),
        ended=since + timedelta(hours=3),
        state=Replica.State.STOPPED,
        **on_gpu,
    )
    _replica(deployment, created=since - timedelta(hours=5), state=Replica.State.READY, **on_gpu)
    _replica(deployment, created=since, state=Replica.State.READY, worker=gpu.worker, gpu=None)
    # idle: failed an hour after it was placed, which was 30 minutes before the period ended;
    # another ended before the period and one was placed after it: neither counts.
    idle_deployment = DeploymentFactory(model=idle)
    _replica(
        idle_deployment,
        created=until - timedelta(minutes=30),
        ended=until + timedelta(minutes=30),
        state=Replica.State.FAILED,
        **on_gpu,
    )
    _replica(
        idle_deployment,
        created=since - timedelta(hours=3),
        ended=since - timedelta(hours=1),
        state=Replica.State.STOPPED,
        **on_gpu,
    )
    _replica(idle_deployment, created=until + timedelta(hours=1), state=Replica.State.LOADING, **on_gpu)
    tenant = _funded_tenant()
    for _ in range(4):
        usage_record_settled(tenant=tenant, model=earning, at=since + timedelta(hours=2), cached_prompt_tokens=6)
    usage_record_settled(tenant=tenant, model=earning, at=until + timedelta(hours=1))  # after the period

    margins = model_margins(since=since, until=until, gpu_hour_cost=Decimal("0.25"))
    assert [(m.model, m.requests, m.revenue, round(m.gpu_hours, 6), m.gpu_cost, m.margin) for m in margins] == [
        ("earning", 4, Decimal("6.000000"), 12.0, Decimal("3.000000"), Decimal("3.000000")),
        ("idle", 0, Decimal("0"), 0.5, Decimal("0.125000"), Decimal("-0.125000")),
    ]
    # The prefill its prefix caches saved: 4 requests of 10 prompt tokens, 6 of each from the cache.
    assert [m.prefill_tokens_saved for m in margins] == [24, 0]


def _replica(deployment, *, created, state, ended=None, **placement):
    replica = ReplicaFactory(
        deployment=deployment,
        state=state,
        endpoint_url="http://w:1" if state == Replica.State.READY else "",
        **placement,
    )
    # Both are the replica's recorded history; set as a replica's transitions would have set them.
    Replica.objects.filter(pk=replica.pk).update(created_at=created, state_changed_at=ended or created)
    return replica


def test_busy_gpu_time_is_the_requests_gpu_seconds_times_their_replicas_gpus_and_adds_up():
    since, until = T0, T0 + timedelta(hours=10)
    chat = ModelFactory(public_name="chat", price_tier=PriceTierFactory(price_per_request=Decimal("1")))
    big = ModelFactory(public_name="big", price_tier=PriceTierFactory(price_per_request=Decimal("2")))
    gpu = GpuFactory()
    placed = dict(created=since - timedelta(hours=1), state=Replica.State.READY, worker=gpu.worker, gpu=gpu)
    one_gpu = _replica(DeploymentFactory(model=chat), **placed)
    two_gpus = _replica(DeploymentFactory(model=big), **placed)
    Replica.objects.filter(pk=two_gpus.pk).update(tensor_parallel_size=2)
    tenant = _funded_tenant()
    inside = since + timedelta(hours=1)
    for seconds in (1800.0, 900.0, 900.0):
        usage_record_settled(tenant=tenant, model=chat, replica=one_gpu, gpu_time_s=seconds, at=inside)
    usage_record_settled(tenant=tenant, model=big, replica=two_gpus, gpu_time_s=900.0, at=inside)
    # Refused before any replica ran it; and one after the period: neither counts.
    usage_record_settled(tenant=tenant, model=chat, status="failed", at=inside)
    usage_record_settled(tenant=tenant, model=chat, replica=one_gpu, gpu_time_s=3600.0, at=until)

    margins = {m.model: m for m in model_margins(since=since, until=until, gpu_hour_cost=Decimal("0.8"))}
    chat_row, big_row = margins["chat"], margins["big"]
    assert (chat_row.requests, chat_row.revenue, chat_row.gpu_busy_hours) == (4, Decimal("3.000000"), 1.0)
    assert (chat_row.busy_cost, chat_row.served_margin) == (Decimal("0.800000"), Decimal("2.200000"))
    assert (big_row.gpu_busy_hours, big_row.busy_cost, big_row.served_margin) == (
        0.5,
        Decimal("0.400000"),
        Decimal("1.600000"),
    )
    # Busy time is part of the time held: the two replicas were placed before the period and
    # held their GPUs through it (1 + 2 GPUs for 10 hours).
    assert (chat_row.gpu_hours, big_row.gpu_hours) == (10.0, 20.0)
    assert chat_row.utilisation_pct == 10.0 and big_row.utilisation_pct == 2.5


def test_the_admin_home_totals_add_up_from_the_rows(client, settings):
    settings.GPU_HOUR_COST_USD = Decimal("1.2")
    model = ModelFactory(public_name="chat", price_tier=PriceTierFactory(price_per_request=Decimal("1")))
    replica = ReplicaFactory(deployment=DeploymentFactory(model=model))
    tenant = _funded_tenant()
    for seconds in (600.0, 1200.0):
        usage_record_settled(tenant=tenant, model=model, replica=replica, gpu_time_s=seconds)
    home = admin_home(now=datetime.now(UTC) + timedelta(seconds=1))
    assert home.gpu_busy_hours == sum(m.gpu_busy_hours for m in home.margins) == 0.5
    assert home.busy_cost == Decimal("0.600000") and home.served_margin == home.revenue - Decimal("0.6")
    assert home.revenue == sum(m.revenue for m in home.margins) == Decimal("2")
