"""Refused requests as the gateway counts them: each answered with an error and not served goes to
the Prometheus counters (metrics.request_finished) and, through the same call (`request_counted`),
to a tally written to the database in batches (billing.refusals), for the tenant's request log and
the operator's error figures.

Why tallies: a client can make refusals as fast as it can send requests (a bad key costs it
nothing), and a row per refusal would let it write to the database at that rate. Refusals of one
kind (tenant, key, model, endpoint, status, error code) within one minute add to one counter here,
and the counters are written together every `flush_s`: the rows written per interval are bounded
by the kinds seen, and the kinds by MAX_KINDS (past it, a new kind is counted without its tenant,
key and model). Refusals without a valid key all share one kind per endpoint, status and code.

Every /v1 answer but a stream (relay counts those), a route's or the router's own 404 and 405,
comes through `request_counted` (app.build_app), which labels it with its route
(metrics.endpoint_of) for both.
"""

import asyncio
import json
import logging
import time
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import Response

from controlplane.billing.refusals import SHED_ERROR_CODE, RefusalTally, refusals_record
from controlplane.gateway import metrics
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.errors import GatewayError

logger = logging.getLogger(__name__)

MAX_KINDS = 2000
SHED = "shed"  # the metrics' outcome of a shed request
# Failed writes are logged at most this often (a database outage must not flood the log).
_WARN_EVERY_S = 60.0

# minute, tenant, key, model, endpoint, status, code
_Kind = tuple[int, int | None, int | None, int | None, str, int, str]


class RefusalLog:
    """This process's refusal tallies, written every `flush_s` on `lane`."""

    def __init__(self, lane: DatabaseLane, flush_s: float, max_kinds: int = MAX_KINDS):
        self._lane, self._flush_s, self._max_kinds = lane, flush_s, max_kinds
        self._tallies: dict[_Kind, list] = {}  # kind -> [count, reason, request_id]
        self._flush: asyncio.Task | None = None
        self._warned_at = float("-inf")

    def add(
        self,
        *,
        status: int,
        error_code: str,
        reason: str,
        request_id: str,
        tenant_id: int | None,
        api_key_id: int | None,
        model_id: int | None,
        endpoint: str,
        at: float,
    ) -> None:
        minute = int(at // 60)
        kind = (minute, tenant_id, api_key_id, model_id, endpoint, status, error_code)
        if kind not in self._tallies and len(self._tallies) >= self._max_kinds:
            kind = (minute, None, None, None, endpoint, status, error_code)  # the routes are few
        tally = self._tallies.get(kind)
        if tally is None:
            self._tallies[kind] = [1, reason, request_id]
        else:
            tally[0] += 1
            tally[1:] = reason, request_id
        self._schedule()

    def _schedule(self) -> None:
        """Write what is counted in `flush_s`, unless a flush is already under way (it writes on
        until nothing is left)."""
        if self._flush is None or self._flush.done():
            self._flush = asyncio.ensure_future(self._flush_later())

    @property
    def pending(self) -> int:
        """Kinds counted and not yet written."""
        return len(self._tallies)

    async def _flush_later(self) -> None:
        # Kinds counted while a write waits on the lane (settlements share it) are not in that
        # write, and no later refusal may come to schedule another: this flush writes them too.
        while self._tallies:
            await asyncio.sleep(self._flush_s)
            await self.flush()

    async def flush(self) -> None:
        tallies, self._tallies = self._tallies, {}
        if not tallies:
            return
        rows = [
            RefusalTally(
                minute=datetime.fromtimestamp(kind[0] * 60, UTC),
                tenant_id=kind[1],
                api_key_id=kind[2],
                model_id=kind[3],
                endpoint=kind[4],
                status=kind[5],
                error_code=kind[6],
                reason=reason,
                request_id=request_id,
                count=count,
            )
            for kind, (count, reason, request_id) in tallies.items()
        ]
        try:
            await self._lane.run(refusals_record, tallies=rows)
        except Exception:
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                logger.warning("could not record %d kinds of refused requests", len(rows), exc_info=True)
            for kind, (count, reason, request_id) in tallies.items():  # the next flush tries again
                tally = self._tallies.setdefault(kind, [0, reason, request_id])
                tally[0] += count
            self._schedule()

    async def aclose(self) -> None:
        if self._flush is not None and not self._flush.done():
            self._flush.cancel()
            await asyncio.gather(self._flush, return_exceptions=True)
        try:
            await self.flush()
        except Exception:
            logger.warning("could not record the last refused requests", exc_info=True)


def request_counted(log: RefusalLog | None, request: Request, response: Response, request_id: str, started: float):
    """Count an answered /v1 request for /metrics and, when it was refused and nothing else records
    it (a usage record), in `log`: the one place both learn of it."""
    status = response.status_code
    refused = status >= 400 and status != metrics.CLIENT_CLOSED_REQUEST and not _recorded(request)
    code, reason = _error_of(request, response) if refused else ("", "")
    outcome = SHED if code == SHED_ERROR_CODE else metrics.outcome_of_status(status)
    endpoint = metrics.endpoint_of(request.scope)
    metrics.request_finished(
        model=getattr(request.state, "model", ""),
        endpoint=endpoint,
        started=started,
        outcome=outcome,
        status=status,
    )
    if refused and log is not None:
        grant = getattr(request.state, "grant", None)
        log.add(
            status=status,
            error_code=code,
            reason=reason,
            request_id=request_id,
            tenant_id=grant.tenant_id if grant else None,
            api_key_id=grant.key_id if grant else None,
            model_id=getattr(request.state, "model_id", None),
            endpoint=endpoint,
            at=time.time(),
        )


def _recorded(request: Request) -> bool:
    """Whether the request's flight wrote a usage record (a failure after a replica was tried)."""
    flight = getattr(request.state, "flight", None)
    return flight is not None and flight.recorded


def _error_of(request: Request, response: Response) -> tuple[str, str]:
    """The error code and message the client got: the raised error's, else its body's."""
    error = getattr(request.state, "error", None)
    if isinstance(error, GatewayError) and error.status == response.status_code:
        return error.code or error.type or "", error.message
    try:
        body = json.loads(response.body)
        detail = body["error"]
        return str(detail.get("code") or detail.get("type") or ""), str(detail.get("message") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", ""
