"""State all gateway processes share, in Redis: rate limits and requests in flight (per key, per
tenant, per replica), the prompt tokens routed to each replica since its load report (which the
shedding rule adds to the report's queue), replicas passed over after failing, first-token marks,
idempotent results, and the channel that announces key changes.

Admission (both per-minute limits and both concurrency limits) is one Lua script (`scripts`), so
it is atomic across processes; so is the choice of replica, and the hot path runs both in one
call. In-flight entries are sorted-set members scored by
their deadline, so a process that dies mid-request leaks nothing: its entries simply expire.
"""

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from controlplane.accounts.services import API_KEY_CHANGES_CHANNEL
from controlplane.batches.models import is_batch_request
from controlplane.fleet.cold_start_counts import redis_key
from controlplane.gateway import scripts
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.selectors import LOAD_REPORT_MAX_AGE_S, KeyGrant, ReplicaRoute

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    allowed: bool
    reason: str  # the limit that refused it, or the per-minute limit the headers describe
    retry_after_ms: int
    limit: int
    remaining: int
    reset_ms: int

    def headers(self) -> dict[str, str]:
        headers = {
            "x-ratelimit-limit-requests": str(self.limit),
            "x-ratelimit-remaining-requests": str(self.remaining),
            "x-ratelimit-reset-requests": _duration(self.reset_ms),
        }
        if not self.allowed:
            headers["retry-after"] = str(max(1, -(-self.retry_after_ms // 1000)))
            headers["retry-after-ms"] = str(self.retry_after_ms)
        return headers


def _admission(reply) -> Admission:
    allowed, reason, retry_ms, limit, remaining, reset_ms = reply
    return Admission(bool(allowed), reason.decode(), int(retry_ms), int(limit), int(remaining), int(reset_ms))


# How long a replica's log of routed requests keeps one: past any load report the gateway reads.
ROUTED_LOG_MS = int(2 * LOAD_REPORT_MAX_AGE_S * 1000)


def _routed_keys(replica_id: int) -> list[str]:
    """A replica's log of the requests routed to it (time by request) and their prompt tokens."""
    return [f"gw:routed:{replica_id}", f"gw:routed_tokens:{replica_id}"]


def _routed(reply: list) -> list[tuple[float, int]]:
    """The pick script's requests routed since a load report (times in ms and prompt tokens, one
    flat list) as (epoch seconds, prompt tokens)."""
    return [(float(reply[i]) / 1000, int(reply[i + 1])) for i in range(0, len(reply) - 1, 2)]


def _duration(ms: int) -> str:
    """OpenAI's format for reset times: 20ms, 1.5s, 6m0s."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, seconds = divmod(ms / 1000, 60)
    return f"{int(minutes)}m{seconds:.0f}s" if minutes else f"{seconds:.3g}s"


class RedisShared:
    def __init__(self, config: GatewayConfig):
        self._config = config
        self._redis = aioredis.Redis.from_url(
            config.redis_url, socket_connect_timeout=2, socket_timeout=5, max_connections=512
        )
        self._admit = self._redis.register_script(scripts.ADMIT)
        self._pick = self._redis.register_script(scripts.PICK)
        self._admit_and_pick = self._redis.register_script(scripts.ADMIT_AND_PICK)
        self._finish = self._redis.register_script(scripts.FINISH)
        self._entry_ms = int(config.hold_lifetime_s * 1000)
        # A first-token mark must outlive the hold it vouches for until the sweeper has seen it.
        self._started_ms = int((config.hold_lifetime_s + 2 * config.hold_sweep_s + 60) * 1000)
        self._sync: redis.Redis | None = None

    async def admit(self, grant: KeyGrant, request_id: str) -> Admission:
        return _admission(await self._admit(**self._admit_call(grant, request_id)))

    def _admit_call(self, grant: KeyGrant, request_id: str) -> dict:
        k, t = grant.key_id, grant.tenant_id
        return {
            "keys": [f"gw:rate:key:{k}", f"gw:rate:tenant:{t}", f"gw:busy:key:{k}", f"gw:busy:tenant:{t}"],
            "args": [
                grant.key_rate_limit_per_minute,
                grant.tenant_rate_limit_per_minute,
                grant.key_max_concurrent,
                grant.tenant_max_concurrent,
                request_id,
                self._entry_ms,
            ],
        }

    async def pick(
        self, candidates: Sequence[ReplicaRoute], request_id: str, affinity: int | None, prompt_tokens: int = 0
    ) -> ReplicaRoute:
        """Choose among `candidates` (non-empty) and count the request as outstanding there, with
        its `prompt_tokens` routed there since the replica's load report; the route answered
        predicts its wait with the prompt tokens routed there before it (ReplicaRoute.with_routed)."""
        index, routed = await self._pick(**self._pick_call(candidates, request_id, affinity, prompt_tokens))
        return candidates[int(index) - 1].with_routed(_routed(routed))

    async def admit_and_pick(
        self,
        grant: KeyGrant,
        request_id: str,
        candidates: Sequence[ReplicaRoute],
        affinity: int | None,
        prompt_tokens: int = 0,
    ) -> tuple[Admission, ReplicaRoute | None]:
        """`admit`, and if admitted `pick`, in one script call (the hot path's usual case)."""
        admit = self._admit_call(grant, request_id)
        pick = self._pick_call(candidates, request_id, affinity, prompt_tokens)
        reply = await self._admit_and_pick(keys=admit["keys"] + pick["keys"], args=admit["args"] + pick["args"][2:])
        admission = _admission(reply[:6])
        if not admission.allowed:
            return admission, None
        return admission, candidates[int(reply[6]) - 1].with_routed(_routed(reply[7]))

    def _pick_call(
        self, candidates: Sequence[ReplicaRoute], request_id: str, affinity: int | None, prompt_tokens: int
    ) -> dict:
        keys = []
        for replica in candidates:
            keys += [
                f"gw:outstanding:{replica.replica_id}",
                f"gw:down:{replica.replica_id}",
                *_routed_keys(replica.replica_id),
            ]
        return {
            "keys": keys,
            "args": [
                request_id,
                self._entry_ms,
                0 if affinity is None else affinity + 1,
                self._config.affinity_max_extra,
                prompt_tokens,
                ROUTED_LOG_MS,
                *(int(replica.report_at * 1000) for replica in candidates),
            ],
        }

    async def interactive_outstanding(self, replica_ids: Sequence[int]) -> dict[int, int]:
        """Requests in flight on each replica, batch lines left out: batch work fills what is idle."""
        now = time.time() * 1000
        async with self._redis.pipeline(transaction=False) as pipe:
            for replica_id in replica_ids:
                pipe.zrangebyscore(f"gw:outstanding:{replica_id}", now, "+inf")
            replies = await pipe.execute()
        return {
            replica_id: sum(1 for member in members if not is_batch_request(member.decode()))
            for replica_id, members in zip(replica_ids, replies)
        }

    async def finish(
        self,
        request_id: str,
        *,
        grant: KeyGrant | None = None,
        replica_id: int | None = None,
        replica_failed: bool = False,
        started: bool = False,
    ) -> None:
        """The request no longer counts against its key and tenant (with `grant`) and no longer
        runs on `replica_id`, which failed it if `replica_failed`; `started`: also `mark_started`."""
        key, tenant = (f"gw:busy:key:{grant.key_id}", f"gw:busy:tenant:{grant.tenant_id}") if grant else ("", "")
        outstanding, down = (f"gw:outstanding:{replica_id}", f"gw:down:{replica_id}") if replica_id else ("", "")
        routed = _routed_keys(replica_id) if replica_id else ["", ""]
        await self._finish(
            keys=[key, tenant, outstanding, down, f"gw:started:{request_id}", *routed],
            args=[
                request_id,
                int(self._config.replica_cooldown_s * 1000) if replica_failed and replica_id else 0,
                self._started_ms if started else 0,
            ],
        )

    async def mark_started(self, request_id: str) -> None:
        """Remember that the request sent its first token, for the sweeper should we die now."""
        await self._redis.set(f"gw:started:{request_id}", 1, px=self._started_ms)

    def started_sync(self, request_ids: list[str]) -> set[str]:
        """Which of these requests had sent a first token (called from a database thread)."""
        if self._sync is None:
            self._sync = redis.Redis.from_url(self._config.redis_url, socket_connect_timeout=2, socket_timeout=5)
        found = self._sync.mget([f"gw:started:{rid}" for rid in request_ids])
        return {rid for rid, value in zip(request_ids, found) if value is not None}

    async def take_turn(self, name: str, seconds: float) -> bool:
        """True for one caller among all processes per `seconds` (for periodic chores)."""
        return bool(await self._redis.set(f"gw:turn:{name}", 1, nx=True, px=int(seconds * 1000)))

    # --- cold starts ----------------------------------------------------------------------------

    async def cold_start_join(self, model_id: int, request_id: str, wait_s: float) -> None:
        """Count the request as waiting for the model's first ready replica, for at most `wait_s`."""
        now_ms = int(time.time() * 1000)
        key = redis_key(model_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(key, "-inf", now_ms)  # entries of processes that died waiting
            pipe.zadd(key, {request_id: now_ms + int(wait_s * 1000)})
            pipe.pexpire(key, int(wait_s * 1000) + 60_000)
            await pipe.execute()

    async def cold_start_leave(self, model_id: int, request_id: str) -> None:
        await self._redis.zrem(redis_key(model_id), request_id)

    # --- Idempotency-Key --------------------------------------------------------------------

    async def idempotency_begin(self, scope: str, fingerprint: str) -> dict | None:
        """None when this request now owns the key; otherwise the stored entry (pending or done)."""
        key = f"gw:idempotency:{scope}"
        pending = json.dumps({"state": "pending", "fingerprint": fingerprint})
        if await self._redis.set(key, pending, nx=True, px=int(self._config.hold_lifetime_s * 1000)):
            return None
        stored = await self._redis.get(key)
        return json.loads(stored) if stored else {"state": "pending", "fingerprint": fingerprint}

    async def idempotency_store(self, scope: str, entry: dict) -> None:
        await self._redis.set(f"gw:idempotency:{scope}", json.dumps(entry), ex=self._config.idempotency_s)

    async def idempotency_abandon(self, scope: str) -> None:
        await self._redis.delete(f"gw:idempotency:{scope}")

    # --- key changes ------------------------------------------------------------------------

    async def listen_key_changes(self, on_change: Callable[[str], None], on_gap: Callable[[], None]) -> None:
        """Call `on_change(hint)` for every announced key change, forever; `on_gap()` whenever
        (re)subscribed, since announcements made while not subscribed are lost."""
        # A connection of its own without a read timeout: it waits for messages indefinitely.
        listener = aioredis.Redis.from_url(self._config.redis_url, socket_connect_timeout=2, health_check_interval=15)
        failing = False
        try:
            while True:
                try:
                    async with listener.pubsub() as pubsub:
                        await pubsub.subscribe(API_KEY_CHANGES_CHANNEL)
                        failing = False
                        on_gap()
                        async for message in pubsub.listen():
                            if message["type"] == "message":
                                on_change(message["data"].decode())
                except asyncio.CancelledError:
                    raise
                except Exception:
                    if not failing:  # once per outage, not every second of it
                        logger.warning("lost the API key change channel; resubscribing", exc_info=True)
                    failing = True
                    on_gap()
                    await asyncio.sleep(1.0)
        finally:
            await listener.aclose()

    async def aclose(self) -> None:
        await self._redis.aclose()
        if self._sync is not None:
            self._sync.close()
