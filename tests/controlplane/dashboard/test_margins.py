"""The margin per model: billing's revenue against the GPU-hours the fleet's replicas held."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from controlplane.billing.services import credit_grant
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
