"""Requests per model as the gateways see them, for the autoscaler and weight staging: counts in
time buckets (the request rate, and which models are most used over a longer window) and each
model's last request. The fleet owns the counts; the gateway writes them through `traffic_recorder`.

The hot path records once per request, in the background: in Redis one pipelined HINCRBY (the
bucket's hash, model id → count, expiring after the longest window read) and ZADD GT (model id →
time of its last request, kept if later). Without Redis (`make run`: one gateway process) the counts stay in the
process and are written to the shared "live" cache about once a second, which the Celery worker
reads. `traffic_snapshot` is the control plane's reader for both.
"""

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis
from django.conf import settings
from django.core.cache import caches

logger = logging.getLogger(__name__)

BUCKET_SECONDS = 10
_BUCKET_KEY = "gw:traffic:{bucket}"  # hash: model id -> requests in that bucket
_LAST_KEY = "gw:traffic:last"  # sorted set: model id scored by the epoch seconds of its latest request
_LOCAL_CACHE_KEY = "gateway:traffic"  # the embedded set-up's snapshot in the "live" cache
# Failures to record are logged at most this often (a Redis outage must not flood the log).
_WARN_EVERY_S = 60.0


def bucket_of(now: float) -> int:
    return int(now // BUCKET_SECONDS)


def _keep_seconds() -> int:
    """How long a bucket must live: the longest window any reader asks about, and one bucket more."""
    return max(settings.AUTOSCALE_POPULAR_WINDOW_SECONDS, settings.AUTOSCALE_RATE_WINDOW_SECONDS) + 2 * BUCKET_SECONDS


class _Warner:
    def __init__(self) -> None:
        self._last = 0.0

    def warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last >= _WARN_EVERY_S:
            self._last = now
            logger.warning(
                "could not record gateway traffic (%s); the autoscaler sees fewer requests", what, exc_info=True
            )


class RedisTraffic:
    def __init__(self, redis_url: str):
        self._redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
        self._keep_s = _keep_seconds()
        self._warner = _Warner()

    async def record(self, model_id: int, now: float) -> None:
        """Count one request for `model_id` at `now`; never raises (the request goes on regardless)."""
        key = _BUCKET_KEY.format(bucket=bucket_of(now))
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(key, str(model_id), 1)
                pipe.expire(key, self._keep_s)
                pipe.zadd(_LAST_KEY, {str(model_id): now}, gt=True)  # never moves back
                await pipe.execute()
        except Exception:
            self._warner.warn("Redis")

    async def record_shed(self, model_id: int, now: float) -> None:
        """Count one request for `model_id` shed at `now` (already counted by `record`)."""
        key = _BUCKET_KEY.format(bucket=bucket_of(now))
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(key, _shed_field(model_id), 1)
                pipe.expire(key, self._keep_s)
                await pipe.execute()
        except Exception:
            self._warner.warn("Redis")

    async def aclose(self) -> None:
        await self._redis.aclose()


class LocalTraffic:
    """The same counts in the process, flushed to the shared "live" cache a second after a change."""

    FLUSH_AFTER_S = 1.0

    def __init__(self) -> None:
        self._buckets: dict[int, Counter] = {}
        self._last: dict[int, float] = {}
        self._keep_s = _keep_seconds()
        self._flush: asyncio.Task | None = None
        self._warner = _Warner()

    async def record(self, model_id: int, now: float) -> None:
        self._buckets.setdefault(bucket_of(now), Counter())[model_id] += 1
        self._last[model_id] = max(now, self._last.get(model_id, 0.0))
        if self._flush is None or self._flush.done():
            self._flush = asyncio.ensure_future(self._flush_soon())

    async def record_shed(self, model_id: int, now: float) -> None:
        self._buckets.setdefault(bucket_of(now), Counter())[_shed_field(model_id)] += 1

    def snapshot(self, now: float) -> dict:
        oldest = bucket_of(now - self._keep_s)
        for bucket in [b for b in self._buckets if b < oldest]:
            del self._buckets[bucket]
        return {"buckets": {b: dict(c) for b, c in self._buckets.items()}, "last": dict(self._last)}

    async def _flush_soon(self) -> None:
        await asyncio.sleep(self.FLUSH_AFTER_S)
        snapshot = self.snapshot(time.time())
        try:
            await asyncio.to_thread(caches["live"].set, _LOCAL_CACHE_KEY, snapshot, self._keep_s)
        except Exception:
            self._warner.warn("live cache")

    async def aclose(self) -> None:
        if self._flush is not None and not self._flush.done():
            self._flush.cancel()
            await asyncio.gather(self._flush, return_exceptions=True)
        try:  # what the last second counted
            await asyncio.to_thread(caches["live"].set, _LOCAL_CACHE_KEY, self.snapshot(time.time()), self._keep_s)
        except Exception:
            self._warner.warn("live cache")


def _shed_field(model_id: int) -> str:
    """A bucket's field counting the model's shed requests, beside its field counting all of them."""
    return f"shed:{model_id}"


def traffic_recorder(redis_url: str) -> RedisTraffic | LocalTraffic:
    return RedisTraffic(redis_url) if redis_url else LocalTraffic()


# --- The control plane's reader --------------------------------------------------------------


@dataclass(frozen=True)
class TrafficSnapshot:
    """Per model id: requests per second over the rate window, requests over the popularity
    window, and the time of the latest request (epoch seconds)."""

    rate_per_s: dict[int, float]
    window_counts: dict[int, float]
    last_request_at: dict[int, float]
    # Of rate_per_s, the requests shed because the deployment's TTFT objective could not be met.
    shed_rate_per_s: dict[int, float] = field(default_factory=dict)


def traffic_snapshot(*, now: float, rate_window_s: float, popular_window_s: float) -> TrafficSnapshot:
    """What the gateways counted, read once per autoscaling tick (Redis, or the embedded snapshot).
    A window covers the buckets that started within it; the current bucket counts as far as it got."""
    longest = max(rate_window_s, popular_window_s)
    first = bucket_of(now - longest) + 1
    buckets = list(range(first, bucket_of(now) + 1))
    if settings.REDIS_URL:
        counts, last = _read_redis(buckets)
    else:
        stored = caches["live"].get(_LOCAL_CACHE_KEY) or {"buckets": {}, "last": {}}
        counts = {b: stored["buckets"].get(b, {}) for b in buckets}
        last = stored["last"]
    rate_first = bucket_of(now - rate_window_s) + 1
    # Seconds the rate buckets cover, up to now (at least one, so a burst in a young bucket is not inflated).
    covered = max(1.0, now - rate_first * BUCKET_SECONDS)
    rate, window, shed = Counter(), Counter(), Counter()
    for bucket, per_model in counts.items():
        for field_name, count in per_model.items():
            name = str(field_name)
            if name.startswith("shed:"):
                if bucket >= rate_first:
                    shed[int(name[5:])] += count
                continue
            model_id = int(name)
            window[model_id] += count
            if bucket >= rate_first:
                rate[model_id] += count
    return TrafficSnapshot(
        rate_per_s={model_id: count / covered for model_id, count in rate.items()},
        window_counts=dict(window),
        last_request_at=dict(last),
        shed_rate_per_s={model_id: count / covered for model_id, count in shed.items()},
    )


def _read_redis(buckets: list[int]) -> tuple[dict[int, dict[str, int]], dict[int, float]]:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=5)
    try:
        with client.pipeline(transaction=False) as pipe:
            for bucket in buckets:
                pipe.hgetall(_BUCKET_KEY.format(bucket=bucket))
            pipe.zrange(_LAST_KEY, 0, -1, withscores=True)
            replies = pipe.execute()
    finally:
        client.close()
    counts = {bucket: {k.decode(): int(v) for k, v in reply.items()} for bucket, reply in zip(buckets, replies)}
    last = {int(member): float(score) for member, score in replies[-1]}
    return counts, last
