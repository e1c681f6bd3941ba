"""The gateway's side of credit holds, the one module here that calls billing.holds: a hold placed
at admission (`HoldPlacer`), one request's `Flight` from admission to its end, its settlement
batched on the settle lane (`settle_batcher`), and the sweeper that settles holds left behind by
a gateway process that died mid-request.

Placing a hold is on the API's latency path. The common case (the tenant's credit covers the
price, no monthly allowance left to use) is one conditional statement,
`billing.holds.conditional_hold_statement`. Run on the admission lane it costs a hand-off to a
thread and back, which on a busy 2-core host is a good part of the gateway's added latency; so
the gateway runs it on its own asyncio PostgreSQL connection instead. Everything else goes through
the lane's batched, locked path as before: a statement that does not apply (an allowance to use,
credit too low, no account yet), a hold that arrives while another is in flight on either path
(under load, batching is cheaper, and two connections would contend for the same account row),
SQLite, or a database error. Both paths are single transactions against the same rows, so the
guarantees of billing.holds (credit never below zero, each hold consumed once) do not depend on
which one placed a hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from decimal import Decimal
from typing import Any, Protocol

from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from controlplane.billing.holds import (
    HoldRefused,
    HoldRequest,
    RequestOutcome,
    Settled,
    conditional_hold_result,
    conditional_hold_statement,
    credit_hold_adopt,
    credit_holds_expire,
    credit_holds_place,
    credit_holds_place_locked,
    credit_holds_settle,
    usage_cached_tokens,
)
from controlplane.billing.models import CreditHold, UsageRecord
from controlplane.gateway import metrics
from controlplane.gateway.database import Batcher, DatabaseLane
from controlplane.gateway.errors import insufficient_quota, key_budget_exceeded
from controlplane.gateway.selectors import KeyGrant, ModelRoute

logger = logging.getLogger(__name__)


class GatewayParts(Protocol):
    """What flights and the sweeper use of the gateway process (process.Gateway, which owns them)."""

    config: Any
    shared: Any
    holds: HoldPlacer
    settles: Batcher
    settle_lane: DatabaseLane

    def spawn(self, work) -> None: ...


COMPLETED = UsageRecord.Status.COMPLETED
CANCELLED = UsageRecord.Status.CANCELLED
FAILED = UsageRecord.Status.FAILED
# A settlement is retried through a database outage of up to about 40 s (its hold outlives the
# longest request by a minute) with the request's own status and usage; only a longer outage
# leaves it to the sweeper, which knows neither.
_SETTLE_RETRY_PAUSES_S = (0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0)


class HoldPlacer:
    """Places one request's hold: on its own connection when the admission lane is idle, batched on
    the lane otherwise (see above)."""

    def __init__(self, lane: DatabaseLane, hold_lifetime_s: float, database: dict | None = None):
        self._lifetime = timedelta(seconds=hold_lifetime_s)
        self._batched = Batcher(
            lane,
            lambda requests: credit_holds_place(
                requests=requests, at=timezone.now(), expires_at=timezone.now() + self._lifetime
            ),
        )
        self._locked = Batcher(
            lane,
            lambda requests: credit_holds_place_locked(
                requests=requests, at=timezone.now(), expires_at=timezone.now() + self._lifetime
            ),
        )
        database = settings.DATABASES["default"] if database is None else database
        self._connect_kwargs = _connect_kwargs(database)
        self._connection = None
        self._busy = False
        self._lane = lane
        self._adopted: dict[str, Decimal] = {}  # request id -> amount held or charged already

    async def adopt(self, request_id: str) -> None:
        """A request run again under its own id (a background response whose gateway died): what
        was held or charged for it before is its hold this time (billing.holds.credit_hold_adopt)."""
        expires_at = timezone.now() + self._lifetime
        amount = await self._lane.run(credit_hold_adopt, request_id=request_id, expires_at=expires_at)
        if amount is not None:
            self._adopted[request_id] = amount

    def forget_adopted(self, request_id: str) -> None:
        self._adopted.pop(request_id, None)

    async def submit(self, request: HoldRequest) -> CreditHold | HoldRefused:
        """The request's hold, or why it was refused (billing.holds.HoldRefused)."""
        if (amount := self._adopted.pop(request.request_id, None)) is not None:
            return CreditHold(request_id=request.request_id, tenant_id=request.tenant_id, amount=amount)
        # Under load the lane's batches are cheaper, and two connections would only queue on the
        # same account row: the direct path is for a request that finds the lane idle.
        if (
            self._connect_kwargs is None
            or self._busy
            or request.price_per_request is None
            or not (self._batched.idle and self._locked.idle)
        ):
            return await self._batched.submit(request)
        self._busy = True
        at = timezone.now()
        try:
            sql, params = conditional_hold_statement(request, at, at + self._lifetime)
            connection = await self._connect()
            cursor = await connection.execute(sql, params)
            result = await cursor.fetchall()
        except Exception:
            logger.warning("the asynchronous hold path failed; using the admission lane", exc_info=True)
            await self.aclose()
            return await self._batched.submit(request)
        finally:
            self._busy = False
        hold = conditional_hold_result(request, result, at, at + self._lifetime)
        return hold if hold is not None else await self._locked.submit(request)

    async def _connect(self):
        if self._connection is None or self._connection.closed:
            import psycopg

            self._connection = await psycopg.AsyncConnection.connect(autocommit=True, **self._connect_kwargs)
        return self._connection

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                await connection.close()
            except Exception:
                logger.debug("closing the hold connection failed", exc_info=True)


def _connect_kwargs(database: dict) -> dict | None:
    if database.get("ENGINE") != "django.db.backends.postgresql":
        return None
    kwargs = {"dbname": database["NAME"], "connect_timeout": 5}
    for key, name in (("USER", "user"), ("PASSWORD", "password"), ("HOST", "host"), ("PORT", "port")):
        if database.get(key):
            kwargs[name] = str(database[key])
    options = dict(database.get("OPTIONS") or {})
    for name in ("sslmode", "sslrootcert", "sslcert", "sslkey", "application_name"):
        if name in options:
            kwargs[name] = options[name]
    return kwargs


def settle_batcher(lane: DatabaseLane) -> Batcher[RequestOutcome, Settled]:
    """Settlements, batched on `lane`. Not durable: the hold and the first-token mark already make
    a served request's charge survive a crash (see credit_holds_settle), and the commit stays off
    the disk's latency."""
    return Batcher(lane, lambda outcomes: credit_holds_settle(outcomes=outcomes, at=timezone.now(), durable=False))


class Flight:
    """A request from admission to its end, in two steps that each happen once: `release()`
    frees its slots (key, tenant, replica) in Redis, `settle()` turns its credit hold into a
    charge, a free record or nothing (billing.holds). A served request is released before the
    client gets its last byte (so the client's next request finds its slot free) and settled
    after: the settlement's commit is off the latency path, and a crash in between is covered by
    the first-token mark the sweeper reads."""

    def __init__(self, gw: GatewayParts, request_id: str, grant: KeyGrant, model: ModelRoute, num_requests: int):
        self.gw, self.request_id, self.grant, self.model = gw, request_id, grant, model
        self.num_requests = num_requests
        self.image_count = 0  # images the request carried, for its usage record
        self.routed_tokens = 0  # its prompt tokens as estimated for routing (ModelRoute.prompt_tokens_estimate)
        # The prompt tokens the replica said it took, and of those its prefix cache served
        # (`took_prompt`): recorded for a request that ends without its final usage, as a
        # cancelled one does.
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.started = time.monotonic()
        self.amount: Decimal | None = None  # held; None until the hold is placed
        self.replica_id: int | None = None
        self.first_token_at: float | None = None
        self.released = self.settled = False
        self.recorded = False  # settled with a usage record (served, cancelled or failed)

    def took_prompt(self, prompt_tokens: str | None, cached_prompt_tokens: str | None) -> None:
        """What the replica said the request took of its prompt, before its usage: a stream's
        PROMPT_TOKENS_HEADER and CACHED_PROMPT_TOKENS_HEADER, or a whole answer's counts in the
        replica's /requests/{id} answer, each as text (`prompt_tokens_from`)."""
        self.prompt_tokens = prompt_tokens_from(prompt_tokens)
        self.cached_prompt_tokens = prompt_tokens_from(cached_prompt_tokens)

    async def hold(self) -> None:
        """Set the request's price aside; 429 insufficient_quota when the credit cannot cover it,
        429 key_budget_exceeded when the key's monthly spend limit cannot."""
        hold = await self.gw.holds.submit(
            HoldRequest(
                request_id=self.request_id,
                tenant_id=self.grant.tenant_id,
                model_id=self.model.model_id,
                api_key_id=self.grant.key_id,
                num_requests=self.num_requests,
                price_per_request=self.model.price_per_request,
            )
        )
        if isinstance(hold, HoldRefused):
            raise key_budget_exceeded(hold.key_limit) if hold.reason == HoldRefused.KEY_BUDGET else insufficient_quota()
        self.amount = hold.amount

    async def first_token(self) -> None:
        """The first token is about to reach the client: from here on the request is billable.

        The mark goes to Redis before the token goes out, but its reply is not waited for: the
        round trip stays off the time to first token. The command is on the wire when this
        returns (one turn of the loop), so a crash after the client has its token still leaves the
        sweeper a mark to bill by; a mark that fails is logged, and the settlement, written
        after the answer as always, does not depend on it."""
        self.first_token_at = time.monotonic()
        self.gw.spawn(self.gw.shared.mark_started(self.request_id))
        await asyncio.sleep(0)

    async def release(self, *, served: bool = False) -> None:
        """Free the request's slots; `served`: its whole answer is about to go out, so it is
        marked billable (first token) in the same round trip."""
        if self.released:
            return
        self.released = True
        try:
            await self.gw.shared.finish(self.request_id, grant=self.grant, replica_id=self.replica_id, started=served)
        except Exception:
            # Served: the answer is out and its settlement still follows; only a crash before that
            # settlement would now go unbilled (the sweeper finds no mark).
            logger.warning(
                "could not clear request %s from the in-flight sets%s",
                self.request_id,
                " or mark it billable" if served else "",
                exc_info=True,
            )

    async def release_served(self) -> None:
        """The whole answer is about to go out: free the slots and mark the request billable in
        one script call that is sent before the answer but not waited for (see `first_token`)."""
        if not self.released:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            self.gw.spawn(self.release(served=True))
            await asyncio.sleep(0)

    def release_soon(self) -> None:
        if not self.released:
            self.gw.spawn(self.release())

    async def settle(
        self, status: str | None, usage: dict | None = None, completion_tokens: int = 0, error_code: str = ""
    ) -> None:
        """Settle the hold with `status` (see billing.holds.RequestOutcome); a failed request
        carries the `error_code` its client got."""
        if self._begin_settling(status):
            await self._submit(status, usage, completion_tokens, error_code)

    def settle_soon(self, status: str | None, usage: dict | None = None) -> None:
        if self._begin_settling(status):
            self.gw.spawn(self._submit(status, usage, 0))

    async def end(
        self, status: str | None, usage: dict | None = None, completion_tokens: int = 0, error_code: str = ""
    ) -> None:
        try:
            await self.release()
        finally:
            await self.settle(status, usage, completion_tokens, error_code)

    @property
    def cost(self) -> Decimal:
        """What a billed (completed or cancelled) request is charged: its hold."""
        return self.amount or Decimal("0")

    def _begin_settling(self, status: str | None) -> bool:
        if self.settled:
            return False
        self.settled = True
        self.recorded = self.amount is not None and status is not None
        return self.amount is not None

    async def _submit(
        self, status: str | None, usage: dict | None, completion_tokens: int, error_code: str = ""
    ) -> None:
        usage = usage or {}
        outcome = RequestOutcome(
            request_id=self.request_id,
            status=status,
            prompt_tokens=_int(usage.get("prompt_tokens", self.prompt_tokens)),
            # A request left before its usage came (cancelled) keeps what the replica's header said.
            cached_prompt_tokens=usage_cached_tokens(usage)
            if "prompt_tokens_details" in usage
            else self.cached_prompt_tokens,
            completion_tokens=_int(usage.get("completion_tokens", completion_tokens)),
            time_to_first_token_ms=None
            if self.first_token_at is None
            else int((self.first_token_at - self.started) * 1000),
            total_latency_ms=int((time.monotonic() - self.started) * 1000),
            gpu_time_s=usage.get("gpu_time_s"),
            replica_id=self.replica_id,
            error_code=error_code,
            image_count=self.image_count,
        )
        for pause in _SETTLE_RETRY_PAUSES_S:
            try:
                self._count_charge(await self.gw.settles.submit(outcome))
                return
            except DatabaseError:
                logger.warning(
                    "settling %s failed; retrying in %.1f s",
                    self.request_id,
                    pause,
                    exc_info=pause == _SETTLE_RETRY_PAUSES_S[0],
                )  # one traceback per request
                await asyncio.sleep(pause)
        self._count_charge(await self.gw.settles.submit(outcome))  # the last try; if it fails the sweeper takes over

    def _count_charge(self, settled: Settled) -> None:
        if settled.record is not None:
            metrics.credits_charged(model=self.model.public_name, amount=settled.record.price_charged)


def _int(value) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def prompt_tokens_from(text: str | None) -> int:
    """A replica's PROMPT_TOKENS_HEADER (or CACHED_PROMPT_TOKENS_HEADER) value as a count; 0 when
    absent or garbled."""
    return int(text) if text is not None and text.isdigit() else 0


async def sweep_expired_holds(gw: GatewayParts) -> None:
    """Forever: settle expired holds, in one gateway process at a time."""
    interval = gw.config.hold_sweep_s
    while True:
        await asyncio.sleep(interval)
        try:
            if await gw.shared.take_turn("sweep-holds", interval * 0.9):
                settled = await gw.settle_lane.run(
                    credit_holds_expire, now=timezone.now(), started=gw.shared.started_sync
                )
                if settled:
                    logger.info("settled %d expired credit hold(s)", len(settled))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.warning("could not sweep expired credit holds", exc_info=True)
