"""Credit holds at admission, on the API's latency path.

The common case (the tenant's credit covers the price, no monthly allowance left to use) is one
conditional statement, `billing.holds.conditional_hold_statement`. Run on the admission lane it
costs a hand-off to a thread and back, which on a busy 2-core host is a good part of the
gateway's added latency; so the gateway runs it on its own asyncio PostgreSQL connection instead.
Everything else goes through the lane's batched, locked path as before: a statement that does not
apply (an allowance to use, credit too low, no account yet), a hold that arrives while another is
in flight on either path (under load, batching is cheaper, and two connections would contend for
the same account row), SQLite, or a database error.
Both paths are single transactions against the same rows, so the guarantees of billing.holds
(credit never below zero, each hold consumed once) do not depend on which one placed a hold.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from controlplane.billing.holds import (
    HoldRequest, conditional_hold_result, conditional_hold_statement, credit_holds_place,
    credit_holds_place_locked,
)
from controlplane.billing.models import CreditHold
from controlplane.gateway.database import Batcher, DatabaseLane

logger = logging.getLogger(__name__)


class HoldPlacer:
    def __init__(self, lane: DatabaseLane, hold_lifetime_s: float, database: dict | None = None):
        self._lifetime = timedelta(seconds=hold_lifetime_s)
        self._batched = Batcher(lane, lambda requests: credit_holds_place(
            requests=requests, at=timezone.now(), expires_at=timezone.now() + self._lifetime))
        self._locked = Batcher(lane, lambda requests: credit_holds_place_locked(
            requests=requests, at=timezone.now(), expires_at=timezone.now() + self._lifetime))
        database = settings.DATABASES["default"] if database is None else database
        self._connect_kwargs = _connect_kwargs(database)
        self._connection = None
        self._busy = False

    async def submit(self, request: HoldRequest) -> CreditHold | None:
        """The request's hold, or None when the tenant's credit cannot cover it."""
        # Under load the lane's batches are cheaper, and two connections would only queue on the
        # same account row: the direct path is for a request that finds the lane idle.
        if (self._connect_kwargs is None or self._busy or request.price_per_request is None
                or not (self._batched.idle and self._locked.idle)):
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
