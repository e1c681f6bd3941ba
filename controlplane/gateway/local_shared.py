"""The gateway's shared state kept in the process, for the embedded set-up without Redis (`make
run`: one web process, so "shared by all gateway processes" is this one). Same operations and
semantics as `shared.RedisShared`, whose Lua scripts these mirror; tests run both.

What another process must read goes to the live cache (files under VAR_DIR, which every process
shares): the batch runner in the Celery worker yields to the web process's interactive requests in
flight, so the gateway writes each replica's interactive entries there, each with its deadline as
in Redis; the entries of a process that died mid-request lapse at their deadlines.
"""

import asyncio
import math
import time
from collections.abc import Callable, Sequence

from django.core.cache import caches

from controlplane.batches.models import is_batch_request
from controlplane.fleet.cold_start_counts import publish_to_cache
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.replica_choice import least_outstanding
from controlplane.gateway.selectors import KeyGrant, ReplicaRoute
from controlplane.gateway.shared import ROUTED_LOG_MS, Admission

_PERIOD_MS = 60_000.0


def _now_ms() -> float:
    return time.time() * 1000.0


def _in_flight_key(replica_id: int) -> str:
    return f"gateway:in_flight:{replica_id}"


def _publish_in_flight(replica_id: int, entries: dict[str, float]) -> None:
    """One replica's interactive requests in flight in this process: {request id: deadline (ms)}."""
    now = _now_ms()
    last_deadline = max(entries.values(), default=now)
    caches["live"].set(_in_flight_key(replica_id), entries, timeout=int((last_deadline - now) / 1000) + 60)


def _in_flight_counts(replica_ids: Sequence[int]) -> dict[int, int]:
    found = caches["live"].get_many([_in_flight_key(replica_id) for replica_id in replica_ids])
    now = _now_ms()
    return {
        replica_id: sum(deadline > now for deadline in found.get(_in_flight_key(replica_id), {}).values())
        for replica_id in replica_ids
    }


class _Expiring(dict):
    """member -> deadline (ms); members past their deadline do not count."""

    def live(self, now: float) -> int:
        for member in [m for m, deadline in self.items() if deadline <= now]:
            del self[member]
        return len(self)


class LocalShared:
    def __init__(self, config: GatewayConfig):
        self._config = config
        self._entry_ms = config.hold_lifetime_s * 1000
        self._started_ms = (config.hold_lifetime_s + 2 * config.hold_sweep_s + 60) * 1000
        self._tats: dict[str, float] = {}
        self._busy: dict[str, _Expiring] = {}
        self._outstanding: dict[int, _Expiring] = {}
        self._down: dict[int, float] = {}
        # Replica id -> request id -> (when it was routed there (ms), its prompt tokens).
        self._routed: dict[int, dict[str, tuple[float, int]]] = {}
        self._started = _Expiring()
        self._turns: dict[str, float] = {}
        self._idempotency: dict[str, tuple[float, dict]] = {}
        self._cold_starts: dict[int, dict[str, float]] = {}  # model id -> request id -> deadline (epoch s)

    async def admit(self, grant: KeyGrant, request_id: str) -> Admission:
        now = _now_ms()
        rates = [
            (f"key:{grant.key_id}", grant.key_rate_limit_per_minute, "key_rpm"),
            (f"tenant:{grant.tenant_id}", grant.tenant_rate_limit_per_minute, "tenant_rpm"),
        ]
        tats = []
        for name, limit, reason in rates:
            interval = _PERIOD_MS / limit
            tat = max(self._tats.get(name, now), now) + interval
            if tat - _PERIOD_MS - now > 0:
                return Admission(
                    False, reason, math.ceil(tat - _PERIOD_MS - now), limit, 0, math.ceil(tat - interval - now)
                )
            tats.append((tat, interval))
        busy = [
            (f"key:{grant.key_id}", grant.key_max_concurrent, "key_concurrency"),
            (f"tenant:{grant.tenant_id}", grant.tenant_max_concurrent, "tenant_concurrency"),
        ]
        for name, limit, reason in busy:
            if self._busy.setdefault(name, _Expiring()).live(now) >= limit:
                return Admission(False, reason, 1000, limit, 0, 1000)
        best = None
        for (name, limit, reason), (tat, interval) in zip(rates, tats):
            self._tats[name] = tat
            left = math.floor((_PERIOD_MS - (tat - now)) / interval)
            if best is None or left < best.remaining:
                best = Admission(True, reason, 0, limit, left, math.ceil(tat - now))
        for name, _, _ in busy:
            self._busy[name][request_id] = now + self._entry_ms
        return best

    async def admit_and_pick(
        self,
        grant: KeyGrant,
        request_id: str,
        candidates: Sequence[ReplicaRoute],
        affinity: int | None,
        prompt_tokens: int = 0,
    ) -> tuple[Admission, ReplicaRoute | None]:
        admission = await self.admit(grant, request_id)
        if not admission.allowed:
            return admission, None
        return admission, await self.pick(candidates, request_id, affinity, prompt_tokens)

    async def pick(
        self, candidates: Sequence[ReplicaRoute], request_id: str, affinity: int | None, prompt_tokens: int = 0
    ) -> ReplicaRoute:
        now = _now_ms()
        counts = [self._outstanding.setdefault(r.replica_id, _Expiring()).live(now) for r in candidates]
        up = [self._down.get(r.replica_id, 0) <= now for r in candidates]
        best = least_outstanding(counts, up, affinity, self._config.affinity_max_extra)
        chosen = candidates[best]
        self._outstanding[chosen.replica_id][request_id] = now + self._entry_ms
        if not is_batch_request(request_id):
            self._publish_interactive(chosen.replica_id)
        log = self._routed.setdefault(chosen.replica_id, {})
        for member in [m for m, (at, _) in log.items() if at <= now - ROUTED_LOG_MS]:
            del log[member]
        since = chosen.report_at * 1000
        routed = sorted((at / 1000, tokens) for at, tokens in log.values() if at >= since)
        if prompt_tokens > 0:
            log[request_id] = (now, prompt_tokens)
        return chosen.with_routed(routed, now / 1000)

    def _publish_interactive(self, replica_id: int) -> None:
        now = _now_ms()
        entries = self._outstanding.get(replica_id, {})
        _publish_in_flight(replica_id, {m: d for m, d in entries.items() if d > now and not is_batch_request(m)})

    async def interactive_outstanding(self, replica_ids: Sequence[int]) -> dict[int, int]:
        """As RedisShared's: requests in flight per replica, batch lines left out; read from the
        live cache, so the batch runner's process sees the web process's requests."""
        return _in_flight_counts(replica_ids)

    async def finish(
        self,
        request_id: str,
        *,
        grant: KeyGrant | None = None,
        replica_id: int | None = None,
        replica_failed: bool = False,
        started: bool = False,
    ) -> None:
        if started:
            await self.mark_started(request_id)
        if grant is not None:
            for name in (f"key:{grant.key_id}", f"tenant:{grant.tenant_id}"):
                self._busy.get(name, {}).pop(request_id, None)
        if replica_id is not None:
            if self._outstanding.get(replica_id, {}).pop(request_id, None) and not is_batch_request(request_id):
                self._publish_interactive(replica_id)
            self._routed.get(replica_id, {}).pop(request_id, None)
            if replica_failed:
                self._down[replica_id] = _now_ms() + self._config.replica_cooldown_s * 1000

    async def mark_started(self, request_id: str) -> None:
        now = _now_ms()
        if len(self._started) > 100_000:
            self._started.live(now)
        self._started[request_id] = now + self._started_ms

    def started_sync(self, request_ids: list[str]) -> set[str]:
        now = _now_ms()
        return {rid for rid in request_ids if self._started.get(rid, 0) > now}

    async def take_turn(self, name: str, seconds: float) -> bool:
        now = _now_ms()
        if self._turns.get(name, 0) > now:
            return False
        self._turns[name] = now + seconds * 1000
        return True

    async def cold_start_join(self, model_id: int, request_id: str, wait_s: float) -> None:
        # The autoscaler runs in another process: it reads the count from the live cache (a write
        # per request joining or leaving, which happens only while a model starts).
        self._cold_starts.setdefault(model_id, {})[request_id] = time.time() + wait_s
        publish_to_cache(model_id, self._cold_starts[model_id])

    async def cold_start_leave(self, model_id: int, request_id: str) -> None:
        waiting = self._cold_starts.get(model_id, {})
        waiting.pop(request_id, None)
        publish_to_cache(model_id, waiting)
        if not waiting:
            self._cold_starts.pop(model_id, None)

    async def idempotency_begin(self, scope: str, fingerprint: str) -> dict | None:
        now = _now_ms()
        stored = self._idempotency.get(scope)
        if stored is not None and stored[0] > now:
            return stored[1]
        self._idempotency[scope] = (now + self._entry_ms, {"state": "pending", "fingerprint": fingerprint})
        return None

    async def idempotency_store(self, scope: str, entry: dict) -> None:
        if len(self._idempotency) > 100_000:
            now = _now_ms()
            self._idempotency = {k: v for k, v in self._idempotency.items() if v[0] > now}
        self._idempotency[scope] = (_now_ms() + self._config.idempotency_s * 1000, entry)

    async def idempotency_abandon(self, scope: str) -> None:
        self._idempotency.pop(scope, None)

    async def listen_key_changes(self, on_change: Callable[[str], None], on_gap: Callable[[], None]) -> None:
        # Nothing announces changes here: the key cache reads them from the database (keys.py).
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        pass
