"""The gateway's shared state, for both implementations: Redis (production: the Lua scripts) and
in-process (the embedded set-up without Redis). Same tests, same answers."""

import asyncio
import os
import time
from decimal import Decimal

import pytest
import redis
from django.core.cache import caches

from controlplane.fleet.cold_start_counts import waiting_in_cache, waiting_in_redis
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.local_shared import LocalShared
from controlplane.gateway.replica_choice import predicted_wait_s
from controlplane.gateway.selectors import KeyGrant, ModelRoute, ReplicaRoute
from controlplane.gateway.shared import Admission, RedisShared, _duration
from tests.conftest import require_service

# Not the database the running-gateway tests use: these flush theirs freely.
REDIS_DB = int(os.environ.get("GATEWAY_SHARED_TESTS_REDIS_DB", "11"))


def _config(redis_url: str = "") -> GatewayConfig:
    return GatewayConfig(
        redis_url=redis_url,
        worker_token="t",
        key_cache_s=30,
        key_changes_poll_s=0.5,
        routing_refresh_s=1,
        cold_start_wait_s=1,
        cold_start_queue_max=4,
        retry_after_s=5,
        connect_timeout_s=1,
        request_timeout_s=60,
        replica_cooldown_s=30,
        max_request_bytes=1 << 20,
        inline_body_bytes=1 << 16,
        body_parsers=1,
        body_parsers_per_tenant=1,
        default_rate_limit_per_minute=60,
        default_max_concurrent_requests=8,
        affinity_prefix_chars=64,
        affinity_max_extra=2,
        idempotency_s=60,
        hold_sweep_s=1,
    )


@pytest.fixture(params=["redis", "local"])
async def shared(request, settings):
    if request.param == "local":
        # The embedded set-up publishes some counts to the live cache for other processes.
        settings.CACHES = {
            **settings.CACHES,
            "live": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": f"shared-{os.getpid()}"},
        }
        caches["live"].clear()  # one test's requests in flight are not the next one's
        yield LocalShared(_config())
        return
    base = os.environ.get("REDIS_URL", "")
    if not base:
        require_service("REDIS_URL is not set")
    url = base.rsplit("/", 1)[0] + f"/{REDIS_DB}" if base.count("/") > 2 else f"{base}/{REDIS_DB}"
    redis.Redis.from_url(url).flushdb()
    state = RedisShared(_config(url))
    yield state
    await state.aclose()


def grant(key_id=1, tenant_id=1, key_rpm=60, tenant_rpm=600, key_concurrent=8, tenant_concurrent=80) -> KeyGrant:
    return KeyGrant(
        key_id=key_id,
        tenant_id=tenant_id,
        expires_at=None,
        allowed_model_ids=None,
        key_rate_limit_per_minute=key_rpm,
        tenant_rate_limit_per_minute=tenant_rpm,
        key_max_concurrent=key_concurrent,
        tenant_max_concurrent=tenant_concurrent,
    )


async def test_per_minute_limit_allows_the_quota_as_a_burst_then_refuses(shared):
    g = grant(key_rpm=3)

    async def go():
        results = [await shared.admit(g, f"r{i}") for i in range(4)]
        for i in range(3):
            await shared.finish(f"r{i}", grant=g)
        return results

    first, second, third, fourth = await go()
    assert (first.allowed, first.limit, first.remaining, first.reason) == (True, 3, 2, "key_rpm")
    assert (second.remaining, third.remaining) == (1, 0)
    assert not fourth.allowed and fourth.reason == "key_rpm" and fourth.remaining == 0
    # One request per 20 s comes back: the next is allowed in about 20 s.
    assert 19_000 <= fourth.retry_after_ms <= 20_000
    assert fourth.headers()["retry-after"] == "20" and fourth.headers()["retry-after-ms"] == str(fourth.retry_after_ms)


async def test_the_tenant_limit_covers_all_its_keys(shared):
    async def go():
        return [await shared.admit(grant(key_id=k, tenant_rpm=2), f"r{k}") for k in (1, 2, 3)]

    results = await go()
    assert [r.allowed for r in results] == [True, True, False]
    assert results[2].reason == "tenant_rpm"
    # The headers describe whichever limit is closer to running out.
    assert (results[1].reason, results[1].limit, results[1].remaining) == ("tenant_rpm", 2, 0)


@pytest.mark.parametrize(
    ("key_concurrent", "tenant_concurrent", "reason"), [(2, 10, "key_concurrency"), (10, 2, "tenant_concurrency")]
)
async def test_concurrency_limits_until_a_request_finishes(shared, key_concurrent, tenant_concurrent, reason):
    g = grant(key_concurrent=key_concurrent, tenant_concurrent=tenant_concurrent)

    async def go():
        a, b, c = [await shared.admit(g, rid) for rid in ("a", "b", "c")]
        await shared.finish("a", grant=g)
        return a, b, c, await shared.admit(g, "d")

    a, b, c, d = await go()
    assert a.allowed and b.allowed and not c.allowed and d.allowed
    assert c.reason == reason and c.retry_after_ms == 1000


async def test_a_refused_request_uses_no_quota(shared):
    g = grant(key_rpm=2, key_concurrent=1)

    async def go():
        first = await shared.admit(g, "a")
        refused = await shared.admit(g, "b")  # busy: refused before counting against the minute
        await shared.finish("a", grant=g)
        return first, refused, await shared.admit(g, "c")

    first, refused, third = await go()
    assert first.allowed and not refused.allowed and third.allowed and third.remaining == 0


REPLICAS = [ReplicaRoute(1, "http://a"), ReplicaRoute(2, "http://b"), ReplicaRoute(3, "http://c")]


async def test_pick_least_outstanding_and_count_it(shared):
    async def go():
        picks = [(await shared.pick(REPLICAS, f"r{i}", None)).replica_id for i in range(6)]
        await shared.finish("r0", replica_id=picks[0])
        return picks, (await shared.pick(REPLICAS, "r6", None)).replica_id

    picks, after = await go()
    assert sorted(picks) == [1, 1, 2, 2, 3, 3]  # spread evenly
    assert after == picks[0]  # the one that just finished a request is now the least busy


async def test_interactive_outstanding_leaves_batch_lines_out(shared):
    one = [REPLICAS[0]]
    await shared.pick(one, "req_a", None)
    await shared.pick(one, "batch_0123:1", None)
    await shared.pick(one, "batch_0123:2", None)
    assert await shared.interactive_outstanding([1, 2]) == {1: 1, 2: 0}
    await shared.finish("req_a", replica_id=1)
    assert await shared.interactive_outstanding([1]) == {1: 0}


async def test_affinity_wins_until_its_replica_is_overloaded(shared):
    async def go():
        # max extra is 2: the affinity replica takes up to 2 more than the least busy one.
        return [(await shared.pick(REPLICAS, f"r{i}", 1)).replica_id for i in range(5)]

    assert await go() == [2, 2, 2, 1, 3]


async def test_a_failed_replica_is_passed_over_unless_all_failed(shared):
    async def go():
        await shared.pick(REPLICAS[:2], "x", None)
        await shared.finish("x", replica_id=1, replica_failed=True)
        avoided = [(await shared.pick(REPLICAS[:2], f"r{i}", 0)).replica_id for i in range(3)]
        await shared.finish("y", replica_id=2, replica_failed=True)
        return avoided, (await shared.pick(REPLICAS[:2], "z", None)).replica_id

    avoided, last_resort = await go()
    assert avoided == [2, 2, 2]  # even for requests whose affinity is the failed one
    assert last_resort == 1  # both failed: the least busy is tried anyway


async def test_started_marks_and_turns(shared):
    async def go():
        await shared.mark_started("a")
        await shared.finish("b", started=True)
        return await shared.take_turn("chore", 1.0), await shared.take_turn("chore", 1.0)

    first, second = await go()
    assert shared.started_sync(["a", "b", "c"]) == {"a", "b"}
    assert (first, second) == (True, False)


async def test_idempotency_entries(shared):
    async def go():
        owned = await shared.idempotency_begin("t:k", "f1")
        pending = await shared.idempotency_begin("t:k", "f1")
        await shared.idempotency_store("t:k", {"state": "done", "fingerprint": "f1", "status": 200, "body": "{}"})
        done = await shared.idempotency_begin("t:k", "f1")
        await shared.idempotency_abandon("t:k")
        return owned, pending, done, await shared.idempotency_begin("t:k", "f2")

    owned, pending, done, after_abandon = await go()
    assert owned is None and pending["state"] == "pending" and done["state"] == "done"
    assert after_abandon is None


def test_reset_durations_in_openais_format():
    assert [_duration(ms) for ms in (20, 1500, 60_000, 360_000)] == ["20ms", "1.5s", "1m0s", "6m0s"]
    assert Admission(True, "key_rpm", 0, 10, 3, 1500).headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "1.5s",
    }


async def test_in_flight_entries_expire_if_a_gateway_dies(shared):
    """A process that dies mid-request leaks nothing: its entries expire with their deadline."""
    shared._entry_ms = 300  # the in-flight lifetime, normally the request timeout plus a minute
    g = grant(key_concurrent=1)

    async def go():
        first = await shared.admit(g, "lost")  # never finished
        busy = await shared.admit(g, "next")
        await asyncio.sleep(0.4)
        return first, busy, await shared.admit(g, "later")

    first, busy, later = await go()
    assert first.allowed and not busy.allowed and later.allowed


async def test_admit_and_pick_counts_the_replica_only_when_admitted(shared):
    g = grant(key_concurrent=1)
    admitted, replica = await shared.admit_and_pick(g, "a", REPLICAS, None)
    refused, none = await shared.admit_and_pick(g, "b", REPLICAS, None)
    assert admitted.allowed and replica.replica_id == 1
    assert not refused.allowed and none is None
    # "b" left nothing behind on the replicas: 2 and 3 are still the least busy, then 1 again.
    assert [(await shared.pick(REPLICAS, f"r{i}", None)).replica_id for i in range(3)] == [2, 3, 1]


def _cold_start_waiting(shared, model_ids: list[int]) -> dict[int, int]:
    """What the autoscaler reads, in the implementation's own store."""
    if isinstance(shared, LocalShared):
        return waiting_in_cache(model_ids)
    return waiting_in_redis(shared._config.redis_url, model_ids)


async def test_requests_waiting_for_a_cold_start_are_counted_per_model_until_they_leave(shared):
    await shared.cold_start_join(7, "r1", 30)
    await shared.cold_start_join(7, "r2", 30)
    await shared.cold_start_join(8, "r3", 30)
    assert _cold_start_waiting(shared, [7, 8, 9]) == {7: 2, 8: 1, 9: 0}
    await shared.cold_start_leave(7, "r1")
    await shared.cold_start_leave(8, "r3")
    await shared.cold_start_leave(8, "r3")  # twice: no harm
    assert _cold_start_waiting(shared, [7, 8]) == {7: 1, 8: 0}


async def test_a_cold_start_wait_past_its_deadline_no_longer_counts(shared):
    # A process that died while its request waited never says it left: the entry lapses.
    await shared.cold_start_join(7, "dead", 0.2)
    await shared.cold_start_join(7, "alive", 30)
    assert _cold_start_waiting(shared, [7]) == {7: 2}
    await asyncio.sleep(0.3)
    assert _cold_start_waiting(shared, [7]) == {7: 1}


def _reported(replica_id: int, waiting_tokens: int, prefill_tokens_per_s: float, age_s: float = 0.0) -> ReplicaRoute:
    """A replica's route as the routing table builds it from a load report received `age_s` ago."""
    figures = {"waiting_tokens": waiting_tokens, "prefill_tokens_per_s": prefill_tokens_per_s}
    return ReplicaRoute(
        replica_id,
        f"http://{replica_id}",
        predicted_wait_s=predicted_wait_s(figures),
        report_at=time.time() - age_s,
        waiting_tokens=waiting_tokens,
        prefill_tokens_per_s=prefill_tokens_per_s,
    )


def _model(ttft_objective_s: float, *ready: ReplicaRoute) -> ModelRoute:
    return ModelRoute(
        model_id=1,
        public_name="m",
        kind="chat",
        price_per_request=Decimal("0.01"),
        created=0,
        context_length=4096,
        max_request_bytes=1 << 20,
        ready=ready,
        loading=False,
        ttft_objective_s=ttft_objective_s,
    )


def _drained(waits: list[float], undrained: list[float], report: ReplicaRoute) -> bool:
    """Whether picks predicted `waits` where, without the replica's prefill since its report,
    they would have predicted `undrained`: each less at most the time since the report (all a
    test can bound it by), and never below 0."""
    since_report_s = time.time() - report.report_at
    return len(waits) == len(undrained) and all(
        max(0.0, full - since_report_s) - 1e-9 <= wait <= full + 1e-9 for wait, full in zip(waits, undrained)
    )


def _another_process(shared):
    """The same shared state as another gateway process sees it (the embedded set-up has one)."""
    return RedisShared(shared._config) if isinstance(shared, RedisShared) else shared


async def test_requests_routed_since_the_load_report_count_until_the_objective_sheds_the_next(shared):
    idle = _reported(1, waiting_tokens=0, prefill_tokens_per_s=1000.0)  # its report: nothing queued
    model = _model(1.0, idle)
    other = _another_process(shared)
    try:
        waits, shed = [], []
        for i in range(6):  # 300 prompt tokens each, picked by two processes in turn, no new report
            process = other if i % 2 else shared
            if i == 0:
                _, replica = await process.admit_and_pick(grant(), "r0", [idle], None, 300)
            else:
                replica = await process.pick([idle], f"r{i}", None, 300)
            waits.append(replica.predicted_wait_s)
            shed.append(model.over_objective(replica))
            if shed[-1]:  # as the gateway does: a shed request never reaches the replica
                await process.finish(f"r{i}", replica_id=1)
        assert _drained(waits, [0.0, 0.3, 0.6, 0.9, 1.2, 1.2], idle)
        assert shed == [False, False, False, False, True, True]
        await shared.finish("r0", replica_id=1)  # done: no longer ahead of anyone
        assert _drained([(await other.pick([idle], "r6", None, 300)).predicted_wait_s], [0.9], idle)
    finally:
        if other is not shared:
            await other.aclose()


async def test_a_newer_load_report_replaces_the_count_of_requests_routed_before_it(shared):
    before = _reported(1, waiting_tokens=0, prefill_tokens_per_s=1000.0)
    for i in range(4):
        await shared.pick([before], f"r{i}", None, 300)
    await asyncio.sleep(0.01)
    # The replica's next report shows what those became (here 600 tokens still queued).
    after = _reported(1, waiting_tokens=600, prefill_tokens_per_s=1000.0)
    assert _drained([(await shared.pick([after], "r4", None, 300)).predicted_wait_s], [0.6], after)
    assert _drained([(await shared.pick([after], "r5", None, 300)).predicted_wait_s], [0.9], after)
    # A process still holding the older report counts everything routed since that one.
    assert _drained([(await shared.pick([before], "r6", None, 300)).predicted_wait_s], [1.8], before)


async def test_what_the_replica_prefilled_since_its_report_is_taken_off_its_queue_and_routed_work(shared):
    # A report 1 s old of 3000 prompt tokens queued at 3000 tok/s: that queue is prefilled by now.
    report = _reported(1, waiting_tokens=3000, prefill_tokens_per_s=3000.0, age_s=1.0)
    model = _model(0.75, report)
    picked = [await shared.pick([report], f"r{i}", None, 1500) for i in range(3)]
    waits = [replica.predicted_wait_s for replica in picked]
    # Each 1500-token request joins the backlog the replica has been draining since the report.
    assert waits[0] == 0.0
    assert _drained(waits, [1.0, 1.5, 2.0], report) and waits[1] <= 0.5 and waits[2] <= 1.0
    assert waits[2] > 0.75  # the report's age bounds the drain: 1 s, and the test's few ms
    assert [model.over_objective(replica) for replica in picked] == [False, False, True]


async def test_a_burst_long_after_an_idle_report_is_shed_the_idle_time_drains_none_of_it(shared):
    # Nothing queued 10 s ago, at 100 tok/s: 1000 tokens' worth of prefill time the replica spent
    # idle, which no request routed since can use.
    report = _reported(1, waiting_tokens=0, prefill_tokens_per_s=100.0, age_s=10.0)
    model = _model(1.0, report)
    sent = time.time()
    first = await shared.pick([report], "r0", None, 900)
    second = await shared.pick([report], "r1", None, 900)
    assert first.predicted_wait_s == 0.0
    # Behind the first request's 900 tokens, less what the replica prefilled since that was sent.
    assert max(0.0, 9.0 - (time.time() - sent)) - 1e-9 <= second.predicted_wait_s <= 9.0 + 1e-9
    assert [model.over_objective(replica) for replica in (first, second)] == [False, True]
