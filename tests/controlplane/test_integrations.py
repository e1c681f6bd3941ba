"""With REDIS_URL set, the cache, the channel layer and Celery really go through Redis (and with
DATABASE_URL, the database is PostgreSQL): these tests talk to the live services."""

import os
import uuid

import pytest
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.cache import cache
from django.db import connection

from controlplane.celery import app as celery_app


def test_ci_runs_against_postgresql():
    if os.environ.get("REQUIRE_SERVICES") != "1":
        pytest.skip("only CI (REQUIRE_SERVICES=1) promises PostgreSQL")
    assert connection.vendor == "postgresql"


def test_cache_goes_through_redis(redis_url):
    assert settings.CACHES["default"]["BACKEND"] == "django.core.cache.backends.redis.RedisCache"
    key, value = f"test:{uuid.uuid4()}", {"answer": 42}
    cache.set(key, value, timeout=30)
    try:
        import redis

        client = redis.Redis.from_url(redis_url)
        assert any(key in k.decode() for k in client.scan_iter(match=f"*{key}*")), "the value is not in Redis"
        assert cache.get(key) == value
    finally:
        cache.delete(key)


async def test_channel_layer_delivers_through_redis(redis_url):
    layer = get_channel_layer()
    assert type(layer).__module__.startswith("channels_redis")
    channel = await layer.new_channel()
    group = f"test-{uuid.uuid4().hex}"
    await layer.group_add(group, channel)
    try:
        await layer.group_send(group, {"type": "fleet.update", "html": "<tr id='worker-1'></tr>"})
        assert await layer.receive(channel) == {"type": "fleet.update", "html": "<tr id='worker-1'></tr>"}
    finally:
        await layer.group_discard(group, channel)


async def test_an_idle_receive_outlasts_the_redis_clients_default_read_timeout(redis_url):
    """A consumer waits on the layer for as long as nothing happens: redis-py 8 cuts reads at 5 s
    by default, which would tear an idle WebSocket consumer down with a TimeoutError."""
    import asyncio

    layer = get_channel_layer()
    channel = await layer.new_channel()
    waiting = asyncio.ensure_future(layer.receive(channel))
    await asyncio.sleep(7)
    assert not waiting.done(), waiting.exception() if waiting.done() else None
    await layer.send(channel, {"type": "test.late", "text": "after 7 s"})
    assert await asyncio.wait_for(waiting, 10) == {"type": "test.late", "text": "after 7 s"}


def test_celery_broker_and_results_are_redis(redis_url):
    assert celery_app.conf.broker_url == redis_url
    assert celery_app.conf.result_backend == redis_url
    with celery_app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
        assert conn.transport.driver_type == "redis"
