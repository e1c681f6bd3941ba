"""The gateway counts each request it serves for the autoscaler, through the fleet's counters
(controlplane/fleet/traffic.py, tested in tests/controlplane/fleet/test_traffic.py)."""

import time

import pytest

from controlplane.fleet.traffic import traffic_snapshot
from tests.controlplane.gateway.conftest import make_world, wait_until


def _snapshot(now):
    return traffic_snapshot(now=now, rate_window_s=60, popular_window_s=3600)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_each_request_through_the_gateway_is_counted_for_its_model(gateway, replicas, settings):
    world = make_world(gateway, replicas)
    settings.REDIS_URL = gateway.redis_url
    world.client().chat.completions.create(
        model=world.model.public_name, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    world.client().completions.create(model=world.model.public_name, prompt="hi", max_tokens=2)
    wait_until(lambda: _snapshot(time.time()).window_counts.get(world.model.pk) == 2, 30, "the requests to be counted")
    assert _snapshot(time.time()).last_request_at[world.model.pk] <= time.time()
    world.settled()
