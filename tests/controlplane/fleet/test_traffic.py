"""The fleet's request counters for the autoscaler, which the gateway writes: recorded in Redis or in
the process (the embedded set-up, flushed to the live cache), read by the control plane; a Redis
outage costs counts, never requests. tests/controlplane/gateway/test_traffic.py counts a real request
through a running gateway."""

import os
import time

import pytest
import redis
from django.conf import settings as django_settings

from controlplane.fleet.traffic import BUCKET_SECONDS, LocalTraffic, RedisTraffic, traffic_snapshot
from tests.conftest import require_service

DOWN = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def _redis_url() -> str:
    if not os.environ.get("REDIS_URL"):
        require_service("REDIS_URL is not set")
    return django_settings.REDIS_URL


@pytest.fixture
def clean_redis():
    client = redis.Redis.from_url(_redis_url())
    for key in client.scan_iter("gw:traffic:*"):
        client.delete(key)
    yield client
    client.close()


def _snapshot(now):
    return traffic_snapshot(now=now, rate_window_s=60, popular_window_s=3600)


async def _record(traffic, model_id, now, count=1):
    for _ in range(count):
        await traffic.record(model_id, now)


async def test_redis_counts_give_rate_window_and_last_request(clean_redis, settings):
    settings.REDIS_URL = _redis_url()
    now = (time.time() // BUCKET_SECONDS) * BUCKET_SECONDS + 5  # 5 s into a bucket
    traffic = RedisTraffic(settings.REDIS_URL)
    await _record(traffic, 7, now, count=3)
    await _record(traffic, 7, now - 600, count=2)  # inside the popularity window, outside the rate one
    await _record(traffic, 8, now - 30)
    await _record(traffic, 9, now - 7200)  # outside both
    await traffic.aclose()
    snapshot = _snapshot(now)
    assert snapshot.window_counts == {7: 5, 8: 1}
    # 3 + 1 requests over the buckets of the last minute (55 s of them have passed).
    assert snapshot.rate_per_s[7] == pytest.approx(3 / 55) and snapshot.rate_per_s[8] == pytest.approx(1 / 55)
    assert snapshot.last_request_at[7] == now and snapshot.last_request_at[8] == now - 30
    # The buckets expire on their own once past the longest window.
    (key,) = [k for k in clean_redis.scan_iter("gw:traffic:*") if k != b"gw:traffic:last" and clean_redis.hget(k, "8")]
    assert 0 < clean_redis.ttl(key) <= django_settings.AUTOSCALE_POPULAR_WINDOW_SECONDS + 2 * BUCKET_SECONDS


async def test_embedded_counts_reach_the_reader_through_the_live_cache(settings):
    settings.REDIS_URL = ""
    now = time.time()
    traffic = LocalTraffic()
    await _record(traffic, 3, now, count=4)
    await _record(traffic, 4, now - 1200)
    await traffic.aclose()  # writes what it counted
    snapshot = _snapshot(now)
    assert snapshot.window_counts == {3: 4, 4: 1}
    assert snapshot.rate_per_s[3] > 0 and 4 not in snapshot.rate_per_s
    assert snapshot.last_request_at == {3: now, 4: now - 1200}


async def test_embedded_counts_are_flushed_without_closing(settings):
    settings.REDIS_URL = ""
    traffic = LocalTraffic()
    await traffic.record(5, time.time())
    deadline = time.monotonic() + 30
    while 5 not in _snapshot(time.time()).window_counts and time.monotonic() < deadline:
        await __import__("asyncio").sleep(0.1)
    assert _snapshot(time.time()).window_counts == {5: 1}
    await traffic.aclose()


async def test_redis_down_loses_counts_but_never_fails_the_request(settings, caplog):
    traffic = RedisTraffic(DOWN)
    await traffic.record(1, time.time())  # does not raise
    await traffic.record(1, time.time())
    await traffic.aclose()
    warnings = [r for r in caplog.records if "could not record gateway traffic" in r.getMessage()]
    assert len(warnings) == 1  # once per outage, not per request
    settings.REDIS_URL = DOWN
    with pytest.raises(redis.ConnectionError):
        _snapshot(time.time())  # the reader says so; the autoscaler then decides nothing


async def test_shed_requests_are_counted_apart_from_and_among_all_requests(clean_redis, settings):
    settings.REDIS_URL = _redis_url()
    now = (time.time() // BUCKET_SECONDS) * BUCKET_SECONDS + 5
    traffic = RedisTraffic(settings.REDIS_URL)
    await _record(traffic, 7, now, count=4)
    await traffic.record_shed(7, now)
    await traffic.aclose()
    snapshot = _snapshot(now)
    assert snapshot.window_counts == {7: 4}  # a shed request is among the requests, counted once
    assert snapshot.shed_rate_per_s == {7: pytest.approx(1 / 55)}


async def test_embedded_shed_counts_reach_the_reader(settings):
    settings.REDIS_URL = ""
    now = time.time()
    traffic = LocalTraffic()
    await _record(traffic, 3, now, count=2)
    await traffic.record_shed(3, now)
    await traffic.aclose()
    snapshot = _snapshot(now)
    assert snapshot.window_counts == {3: 2} and snapshot.shed_rate_per_s[3] == snapshot.rate_per_s[3] / 2
