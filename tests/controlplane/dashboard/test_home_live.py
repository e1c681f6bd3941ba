"""The operators' home is live: its WebSocket (through the real ASGI stack and Redis channel layer)
draws the fleet section on connecting and again after fleet events; tenants are turned away."""

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import Client

from controlplane.accounts.models import User
from controlplane.asgi import application
from controlplane.dashboard.ops.consumers import HomeFleetConsumer
from tests.controlplane.dashboard.ops_support import (  # noqa: F401 (fixtures)
    _private_live_cache,
    beat,
    make_user,
    make_worker,
)
from tests.controlplane.dashboard.websocket_client import WebSocketClient
from tests.controlplane.factories import GpuFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("redis_url")]


@pytest.fixture(autouse=True)
async def _close_worker_thread_connections():
    yield
    await sync_to_async(connections.close_all)()


@sync_to_async
def _cookie(role: str) -> str:
    client = Client()
    client.force_login(make_user(role))
    return f"sessionid={client.cookies['sessionid'].value}"


async def _connect(role: str) -> tuple[WebSocketClient, bool, int | None]:
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost"), (b"cookie", (await _cookie(role)).encode())]
    communicator = WebSocketClient(application, "/ws/home/fleet/", headers=headers)
    connected, code = await communicator.connect()
    return communicator, connected, code


async def test_a_tenant_is_turned_away():
    _, connected, code = await _connect(User.Role.TENANT_MEMBER)
    assert (connected, code) == (False, 4403)


async def test_the_section_is_drawn_on_connecting_and_redrawn_after_a_fleet_event(monkeypatch):
    monkeypatch.setattr(HomeFleetConsumer, "redraw_interval_s", 0.0)
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        first = await communicator.receive_from(timeout=10)
        assert 'id="home-operator"' in first and 'data-connected="true"' in first
        assert 'id="home-workers-online">0<' in first

        worker = await sync_to_async(make_worker)()
        await sync_to_async(GpuFactory)(worker=worker, index=0)
        await sync_to_async(beat)(worker, gpus=[{"index": 0, "utilization_pct": 50.0}])
        for _ in range(10):
            html = await communicator.receive_from(timeout=10)
            if 'id="home-workers-online">1<' in html:
                break
        else:
            pytest.fail("the section was not redrawn with the new worker online")
        assert 'id="home-gpus-busy"' in html
    finally:
        await communicator.disconnect()
