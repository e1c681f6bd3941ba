"""The embedded set-up's channel layer: a group message published in one process (the fleet server,
Celery) reaches the groups of the process whose pages joined them (the web server), once."""

import asyncio
import socket

import pytest

from controlplane.live_relay import MAX_DATAGRAM_BYTES, RelayedInMemoryChannelLayer

EVENT = {"type": "live.event", "event": "worker.heartbeat", "data": {"worker_id": 7, "gpus": [{"index": 0}]}}


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _nothing_more(layer, channel) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):  # a deadline for something that must not come
            await layer.receive(channel)


async def test_an_event_published_in_another_process_reaches_the_pages_group_once():
    port = _free_udp_port()
    web, fleet = RelayedInMemoryChannelLayer(relay_port=port), RelayedInMemoryChannelLayer(relay_port=port)
    page = await web.new_channel()
    await web.group_add("fleet", page)  # a page joins: the web server's layer listens from now on
    await fleet.group_send("fleet", EVENT)
    async with asyncio.timeout(10):
        assert await web.receive(page) == EVENT
    # The web server's own events stay in the process (no echo back to itself).
    await web.group_send("fleet", {**EVENT, "event": "deployment.changed"})
    async with asyncio.timeout(10):
        assert (await web.receive(page))["event"] == "deployment.changed"
    await _nothing_more(web, page)


async def test_bad_datagrams_and_oversized_events_are_dropped_and_the_next_event_arrives():
    port = _free_udp_port()
    web, celery = RelayedInMemoryChannelLayer(relay_port=port), RelayedInMemoryChannelLayer(relay_port=port)
    page = await web.new_channel()
    await web.group_add("fleet", page)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        for garbage in (
            b"not json",
            b'{"group": "fleet"}',
            b'{"group": "bad group!", "message": {}}',
            b'{"group": "fleet", "message": [1]}',
        ):
            other.sendto(garbage, ("127.0.0.1", port))
    await celery.group_send("fleet", {**EVENT, "data": {"blob": "x" * MAX_DATAGRAM_BYTES}})
    await celery.group_send("fleet", EVENT)
    async with asyncio.timeout(10):
        assert await web.receive(page) == EVENT
    await _nothing_more(web, page)


async def test_publishing_with_nobody_listening_never_fails():
    layer = RelayedInMemoryChannelLayer(relay_port=_free_udp_port())
    await layer.group_send("fleet", EVENT)  # the web server is not up, or no page is open
