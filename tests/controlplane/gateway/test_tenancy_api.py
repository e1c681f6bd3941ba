"""The tenant, its plan's fair-share weight and the priority class travel from the gateway to the
replica's engine: read back from the replicas' per-tenant figures (real `python -m gpuworker
serve` processes behind a real gateway)."""

import httpx
import pytest

from tests.controlplane.gateway.conftest import WORKER_TOKEN, make_world
from tests.gpuworker.replica_metrics import tenant_figures

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def served_on(replicas) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """The replicas' per-tenant service (summed) and weights."""
    served, weights = {}, {}
    for replica in replicas:
        text = httpx.get(f"{replica.url}/metrics", headers={"Authorization": f"Bearer {WORKER_TOKEN}"}, timeout=10).text
        one, its_weights = tenant_figures(text)
        for key, tokens in one.items():
            served[key] = served.get(key, 0.0) + tokens
        weights.update(its_weights)
    return served, weights


def test_the_tenant_its_weight_and_a_batch_key_reach_the_engine(gateway, replicas):
    from controlplane.accounts.services import api_key_create
    from tests.controlplane.factories import PlanFactory

    plan = PlanFactory(rate_limit_per_minute=10_000, max_concurrent_requests=500, fair_share_weight=3)
    world = make_world(gateway, replicas, plan=plan)
    tenant = str(world.tenant.pk)
    batch_key = api_key_create(tenant=world.tenant, name="nightly", batch_priority=True)
    messages = [{"role": "user", "content": "hi"}]
    world.client().chat.completions.create(model=world.model.public_name, messages=messages, max_tokens=3)
    world.client(batch_key.plaintext).chat.completions.create(
        model=world.model.public_name, messages=messages, max_tokens=3
    )
    served, weights = served_on(replicas)
    assert served[tenant, "interactive"] > 0 and served[tenant, "batch"] > 0
    assert weights[tenant] == 3.0
    world.settled()
