"""API key checks for the hot path: by hash, from an in-process cache with a short TTL.

Steady traffic costs no database query; a miss reads the key once however many requests wait on
it. Every change to a key, its tenant or its plan is a row in the database (`ApiKeyChange`,
written in the change's own transaction): `follow_changes` reads the recent rows about twice a
second, off the request path, and drops the keys they name. Redis announcements
(`RedisShared.listen_key_changes`) only make that happen at once; a change made while Redis is
down still takes effect at the next read. The TTL is a last bound on staleness.
"""

import asyncio
import logging
import time
from collections.abc import Iterable
from datetime import timedelta

from starlette.requests import Request

from controlplane.accounts.keys import hash_api_key
from controlplane.accounts.selectors import ApiKeyRejected, api_key_changes_recent
from controlplane.accounts.services import ALL_KEYS_CHANGED, LAST_USED_RESOLUTION, api_key_record_use
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.errors import GatewayError, invalid_api_key
from controlplane.gateway.selectors import KeyGrant, key_grant_for, key_grant_for_id

_MAX_ENTRIES = 50_000
# Unknown keys are remembered too (so a flood of bad keys does not become a flood of queries),
# but briefly: a key created a moment ago must start working quickly.
_REJECTION_TTL_S = 2.0
# Each read of the changes covers this much of the past, by the database's clock: a change's row
# carries its transaction's start but is visible only from its commit, so the window must outlast
# any such transaction. A process that could not read for nearly this long drops every key.
_CHANGES_LOOKBACK = timedelta(seconds=60)

logger = logging.getLogger(__name__)


class KeyCache:
    def __init__(self, config: GatewayConfig, lane: DatabaseLane):
        self._config, self._lane = config, lane
        self._entries: dict[str, tuple[float, KeyGrant | str]] = {}  # hash -> (expires, grant or reason)
        self._loading: dict[str, asyncio.Future] = {}
        self._recorded_use: dict[int, float] = {}  # key id -> when last_used_at was last written
        self._background: set[asyncio.Task] = set()
        self._read_changes = asyncio.Event()

    async def request_grant(self, request: Request, authorization: str | None) -> KeyGrant:
        """`authenticate`, the grant noted on `request`: a refusal after it
        is its tenant's (refusals.request_counted)."""
        grant = request.state.grant = await self.authenticate(authorization)
        return grant

    async def note_refused_grant(self, request: Request, authorization: str | None) -> None:
        """For a request refused before its key was checked (a body too large): its grant noted
        on `request` when the key is valid, so that the refusal is its tenant's."""
        try:
            await self.request_grant(request, authorization)
        except GatewayError:
            request.state.grant = None

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

    async def grant_for_id(self, key_id: int | None) -> KeyGrant:
        """The grant of the key with id `key_id`, read now: for work that goes on without its
        caller's plaintext (a background response taken over); a 401 once the key may not be used."""
        if key_id is None:
            raise invalid_api_key("This API key has been deleted.")
        try:
            return await self._lane.run(
                key_grant_for_id,
                key_id=key_id,
                default_rate_limit_per_minute=self._config.default_rate_limit_per_minute,
                default_max_concurrent=self._config.default_max_concurrent_requests,
            )
        except ApiKeyRejected as rejected:
            raise invalid_api_key(rejected.reason) from None

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
                    key_grant_for,
                    plaintext=plaintext,
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

    def forget(
        self, *, key_hashes: Iterable[str] = (), tenant_ids: set[int] = frozenset(), plan_ids: set[int] = frozenset()
    ) -> None:
        """These keys, and every key of these tenants or plans, changed."""
        for key_hash in key_hashes:
            self.revoke_announced(key_hash)
        if tenant_ids or plan_ids:
            self._entries = {
                key_hash: entry
                for key_hash, entry in self._entries.items()
                if not (
                    isinstance(entry[1], KeyGrant)
                    and (entry[1].tenant_id in tenant_ids or entry[1].plan_id in plan_ids)
                )
            }
            self._loading.clear()  # a read in flight may be of one of them: do not cache it

    def change_announced(self, hint: str) -> None:
        """Redis announced a change (a key's hash or ALL_KEYS_CHANGED): drop a named key at once
        and read the recorded changes now."""
        if hint != ALL_KEYS_CHANGED:
            self.revoke_announced(hint)
        self._read_changes.set()

    def read_changes_now(self) -> None:
        self._read_changes.set()

    async def follow_changes(self) -> None:
        """Forever: every `key_changes_poll_s`, or at once when announced, read the recorded key
        changes (one indexed query on this cache's lane) and drop the keys they name."""
        seen: set[int] = set()  # the change rows of the last read: each is acted on once
        last_read: float | None = None
        failing = False
        while True:
            try:
                async with asyncio.timeout(self._config.key_changes_poll_s):
                    await self._read_changes.wait()
            except TimeoutError:
                pass
            self._read_changes.clear()
            started = time.monotonic()
            try:
                rows = await self._lane.run(api_key_changes_recent, within=_CHANGES_LOOKBACK)
            except Exception:
                if not failing:  # once per outage, not twice a second
                    logger.warning("could not read the API key changes; retrying", exc_info=True)
                failing = True
                continue
            failing = False
            if last_read is not None and started - last_read > _CHANGES_LOOKBACK.total_seconds() / 2:
                self.forget_all()  # rows may have left the window unread
            fresh = [row for row in rows if row[0] not in seen]
            seen, last_read = {row[0] for row in rows}, started
            if fresh:
                self.forget(
                    key_hashes=[h for _, h, _, _ in fresh if h],
                    tenant_ids={t for _, _, t, _ in fresh if t is not None},
                    plan_ids={p for _, _, _, p in fresh if p is not None},
                )

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
