"""API key checks for the hot path: by hash, from an in-process cache with a short TTL.

Steady traffic costs no database query; a miss reads the key once however many requests wait on
it. Revocations arrive through Redis (`RedisShared.listen_key_changes`) and drop the cached copy
at once; the TTL bounds how stale anything else (expiry changes, plan changes) can get.
"""

import asyncio
import time

from controlplane.accounts.keys import hash_api_key
from controlplane.accounts.selectors import ApiKeyRejected
from controlplane.accounts.services import LAST_USED_RESOLUTION, api_key_record_use
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.errors import invalid_api_key
from controlplane.gateway.selectors import KeyGrant, key_grant_for

_MAX_ENTRIES = 50_000
# Unknown keys are remembered too (so a flood of bad keys does not become a flood of queries),
# but briefly: a key created a moment ago must start working quickly.
_REJECTION_TTL_S = 2.0


class KeyCache:
    def __init__(self, config: GatewayConfig, lane: DatabaseLane):
        self._config, self._lane = config, lane
        self._entries: dict[str, tuple[float, KeyGrant | str]] = {}  # hash -> (expires, grant or reason)
        self._loading: dict[str, asyncio.Future] = {}
        self._recorded_use: dict[int, float] = {}  # key id -> when last_used_at was last written
        self._background: set[asyncio.Task] = set()

    async def authenticate(self, authorization: str | None) -> KeyGrant:
        """The grant for the bearer key in `authorization`; raises a 401 GatewayError otherwise."""
        scheme, _, plaintext = (authorization or "").partition(" ")
        plaintext = plaintext.strip()
        if scheme.lower() != "bearer" or not plaintext:  # RFC 7235: the scheme is case-insensitive
            raise invalid_api_key("Missing API key: send it as 'Authorization: Bearer sk-...'.")
        key_hash = hash_api_key(plaintext)
        now = time.monotonic()
        entry = self._entries.get(key_hash)
        if entry is None or entry[0] <= now:
            entry = await self._load(key_hash, plaintext)
        grant = entry[1]
        if isinstance(grant, str):
            raise invalid_api_key(grant)
        if grant.expires_at is not None and grant.expires_at <= time.time():
            raise invalid_api_key("This API key has expired.")
        self._note_use(grant.key_id, now)
        return grant

    def forget_all(self) -> None:
        self._entries.clear()

    async def _load(self, key_hash: str, plaintext: str) -> tuple[float, KeyGrant | str]:
        waiting = self._loading.get(key_hash)
        if waiting is not None:
            return await asyncio.shield(waiting)
        future = asyncio.get_running_loop().create_future()
        self._loading[key_hash] = future
        try:
            try:
                grant: KeyGrant | str = await self._lane.run(
                    key_grant_for, plaintext=plaintext,
                    default_rate_limit_per_minute=self._config.default_rate_limit_per_minute,
                    default_max_concurrent=self._config.default_max_concurrent_requests,
                )
                ttl = self._config.key_cache_s
            except ApiKeyRejected as rejected:
                grant, ttl = rejected.reason, min(_REJECTION_TTL_S, self._config.key_cache_s)
            entry = (time.monotonic() + ttl, grant)
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries.clear()
            # A revocation announced while the row was being read must win over what was read.
            if self._loading.get(key_hash) is future:
                self._entries[key_hash] = entry
            future.set_result(entry)
            return entry
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # mark it retrieved: its waiters may all have gone
            raise
        finally:
            if self._loading.get(key_hash) is future:
                del self._loading[key_hash]

    def revoke_announced(self, key_hash: str) -> None:
        """A key changed: drop it, including a read of it still in flight."""
        self._entries.pop(key_hash, None)
        self._loading.pop(key_hash, None)

    def _note_use(self, key_id: int, now: float) -> None:
        # At most one write a minute per key and process; the service's condition makes it one
        # write a minute per key across all processes.
        last = self._recorded_use.get(key_id)
        if last is not None and now - last < LAST_USED_RESOLUTION.total_seconds():
            return
        self._recorded_use[key_id] = now
        task = asyncio.ensure_future(self._record_use(key_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record_use(self, key_id: int) -> None:
        from django.utils import timezone

        try:
            await self._lane.run(api_key_record_use, api_key_id=key_id, at=timezone.now())
        except Exception:  # a hint only; never fail a request over it
            pass
