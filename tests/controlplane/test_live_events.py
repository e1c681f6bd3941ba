"""Heartbeats reach the dashboards: services publish their figures to the "fleet" Channels group
(the real channel layer, Redis in CI), after commit."""

import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.utils import timezone

from controlplane.fleet.services.heartbeats import worker_heartbeat
from controlplane.live_events import FLEET_GROUP
from gpuworker.contract.heartbeat import parse_heartbeat
from tests.controlplane.fleet.conftest import make_worker

pytestmark = pytest.mark.django_db


async def _receive(layer, channel):
    return await asyncio.wait_for(layer.receive(channel), timeout=5)


def test_a_heartbeat_publishes_its_figures_to_the_fleet_group(django_capture_on_commit_callbacks):
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(FLEET_GROUP, channel)
    worker = make_worker()
    heartbeat = parse_heartbeat(
        {"gpus": [{"index": 0, "utilization_pct": 37.0, "power_w": 310.5}], "cpu": {"utilization_pct": 12.0}}
    )
    try:
        with django_capture_on_commit_callbacks(execute=True):
            worker_heartbeat(worker_id=worker.pk, heartbeat=heartbeat, now=timezone.now())
        message = async_to_sync(_receive)(layer, channel)
    finally:
        async_to_sync(layer.group_discard)(FLEET_GROUP, channel)
    assert (message["type"], message["event"]) == ("live.event", "worker.heartbeat")
    data = message["data"]
    assert (data["worker_id"], data["name"]) == (worker.pk, worker.name)
    assert data["gpus"] == [{"index": 0, "utilization_pct": 37.0, "power_w": 310.5}]
    assert data["cpu"] == {"utilization_pct": 12.0}
