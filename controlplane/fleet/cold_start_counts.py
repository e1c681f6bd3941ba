"""How many requests wait for each model's first ready replica (a cold start), over all gateway
processes: read by the autoscaler (`cold_start_waiting`), written by the gateway's shared state
through `redis_key` and `publish_to_cache`. The fleet owns the counts; the gateway imports them.

In Redis, the sorted set `gw:cold_start:<model id>` holds the waiting requests' ids, each scored
by the end of its wait (epoch ms): an entry of a process that died while waiting lapses on its
own. Without Redis (the embedded set-up: one gateway process) that process writes its waiting
requests to the live cache, which every process shares.
"""

import time

import redis
from django.conf import settings
from django.core.cache import caches


def redis_key(model_id: int) -> str:
    return f"gw:cold_start:{model_id}"


def _cache_key(model_id: int) -> str:
    return f"gateway:cold_start:{model_id}"


def cold_start_waiting(*, model_ids: list[int]) -> dict[int, int]:
    """For the autoscaler: {model id: requests waiting for a cold start now}, for these models
    (0 where none waits)."""
    if settings.REDIS_URL:
        return waiting_in_redis(settings.REDIS_URL, model_ids)
    return waiting_in_cache(model_ids)


def waiting_in_redis(redis_url: str, model_ids: list[int]) -> dict[int, int]:
    now_ms = int(time.time() * 1000)
    with redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5) as client:
        pipe = client.pipeline(transaction=False)
        for model_id in model_ids:
            pipe.zcount(redis_key(model_id), f"({now_ms}", "+inf")
        return dict(zip(model_ids, pipe.execute()))


def publish_to_cache(model_id: int, waiting: dict[str, float]) -> None:
    """The embedded gateway's waiting requests of one model: {request id: end of its wait (epoch s)}."""
    last_deadline = max(waiting.values(), default=time.time())
    caches["live"].set(_cache_key(model_id), dict(waiting), timeout=int(last_deadline - time.time()) + 60)


def waiting_in_cache(model_ids: list[int]) -> dict[int, int]:
    found = caches["live"].get_many([_cache_key(model_id) for model_id in model_ids])
    now = time.time()
    return {
        model_id: sum(deadline > now for deadline in found.get(_cache_key(model_id), {}).values())
        for model_id in model_ids
    }
