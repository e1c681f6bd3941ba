"""A batch's lines sent through the gateway's request path: the routing table, the replica choice
and in-flight counts in shared state (so interactive requests see batch load), the upstream pool,
and billing's holds at the batch price, each line settled with its answer in one transaction
(batches.services). Run by a Celery task (gateway.tasks.run_batch) for one time slice under the
batch's lease; the next slice is a new task, behind every other on the broker."""

import asyncio
import collections
import json
import logging
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace

from django.conf import settings
from django.utils import timezone

from controlplane.batches.models import Batch, BatchLine
from controlplane.batches.selectors import batch_lines_pending, batch_model_price, batch_status
from controlplane.batches.services import (
    batch_claim,
    batch_finish,
    batch_line_hold,
    batch_line_settle,
    batch_release,
    batch_validate,
    send_run,
)
from controlplane.billing.holds import HoldRefused, RequestOutcome, usage_cached_tokens
from controlplane.billing.models import UsageRecord
from controlplane.billing.selectors import tenant_fair_share_weight
from controlplane.fleet.services.deployments import deployment_wake
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.dialects.responses import Responses, ResponsesRequest
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.process import shared_state
from controlplane.gateway.replica_choice import affinity_choice, affinity_key, prefix_key_header
from controlplane.gateway.routing import RoutingTable
from controlplane.gateway.upstream import UpstreamError, UpstreamPool
from gpuworker.contract.openai_api import ChatCompletionRequest, ProtocolError, parse_request
from gpuworker.contract.tenancy import tenancy_headers

logger = logging.getLogger(__name__)

_ATTEMPTS = 2  # as an interactive request: the first replica, then once more on another
_RESPONSES = "/v1/responses"
# Batch endpoints served through a dialect (a translation onto the chat request), with its schema.
_DIALECT_SCHEMAS = {_RESPONSES: ResponsesRequest}
_IDLE_POLL_S = 0.05  # how soon a runner looks again for a replica interactive traffic left idle


class LeaseLost(Exception):
    """Another runner took the batch (this one was too slow to renew): stop without finishing."""


@dataclass
class _Run:
    config: GatewayConfig
    lane: DatabaseLane
    batch: Batch
    owner: str
    model_id: int
    price: object
    routing: RoutingTable
    shared: object
    upstream: UpstreamPool
    # Who the replica serves the lines for: the batch's tenant at the batch class.
    tenancy: dict[str, str]


async def run_batch(batch_id: int) -> str:
    """One slice of work on the batch: "busy" (another runner has it), "more" (the next slice was
    sent), or the batch's status once this slice ended it."""
    lane = DatabaseLane("batch")
    owner = uuid.uuid4().hex
    try:
        batch = await lane.run(batch_claim, batch_id=batch_id, owner=owner, now=timezone.now())
        if batch is None:
            return "busy"
        # Renewed on a connection of its own: a long validation on the batch's lane must not let
        # the lease run out.
        lease_lane = DatabaseLane("batch-lease")
        renewing = asyncio.ensure_future(_renew(lease_lane, batch_id, owner))
        more = False
        try:
            if batch.status == Batch.Status.VALIDATING:
                batch = await lane.run(
                    batch_validate, batch_id=batch_id, now=timezone.now(), schema=_DIALECT_SCHEMAS.get(batch.endpoint)
                )
            if batch.status == Batch.Status.IN_PROGRESS and timezone.now() < batch.expires_at:
                more = await _send_lines(lane, batch, owner)
            if not more:
                batch = await lane.run(batch_finish, batch_id=batch_id, now=timezone.now())
        except LeaseLost:
            logger.warning("batch %s: another runner took it over", batch_id)
            return "busy"
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            lease_lane.close()
            await lane.run(batch_release, batch_id=batch_id, owner=owner)
        if more:
            send_run(batch_id)
            return "more"
        return batch.status
    finally:
        lane.close()


async def _renew(lane: DatabaseLane, batch_id: int, owner: str) -> None:
    while True:
        await asyncio.sleep(settings.BATCH_LEASE_SECONDS / 3)
        if await lane.run(batch_claim, batch_id=batch_id, owner=owner, now=timezone.now()) is None:
            return


async def _send_lines(lane: DatabaseLane, batch: Batch, owner: str) -> bool:
    """Send pending lines for one slice, BATCH_CONCURRENCY at a time (each sender takes the next
    line as soon as its last one is answered); True when lines remain for the next slice."""
    priced = await lane.run(batch_model_price, model_name=batch.model_name)
    config = GatewayConfig.from_settings()
    run = _Run(
        config,
        lane,
        batch,
        owner,
        *(priced or (0, None)),
        RoutingTable(config, lane),
        shared_state(config),
        UpstreamPool(connect_timeout_s=config.connect_timeout_s),
        tenancy_headers(
            tenant_id=batch.tenant_id,
            weight=await lane.run(tenant_fair_share_weight, tenant_id=batch.tenant_id),
            batch=True,
        ),
    )
    lines = _PendingLines(lane, batch, chunk=4 * settings.BATCH_CONCURRENCY)
    deadline = time.monotonic() + settings.BATCH_TASK_SLICE_SECONDS
    try:
        if priced is None:
            while (line := await lines.take()) is not None:
                await _fail_all(run, [line], "model_not_found", f"The model {batch.model_name!r} does not exist.")
            return False
        await asyncio.gather(*(_sender(run, lines, deadline) for _ in range(settings.BATCH_CONCURRENCY)))
        return not lines.stopped and bool(await lane.run(batch_lines_pending, batch_id=batch.pk, limit=1))
    finally:
        run.upstream.close()
        await run.shared.aclose()


class _PendingLines:
    """The batch's pending lines in order, each handed out once per slice. Every refill (each
    `chunk` lines) also looks for a cancel or the end of the completion window, and stops there."""

    def __init__(self, lane: DatabaseLane, batch: Batch, chunk: int):
        self._lane, self._batch, self._chunk = lane, batch, chunk
        self._queue: collections.deque[BatchLine] = collections.deque()
        self._after = 0  # the last line number handed out
        self._lock = asyncio.Lock()
        self._exhausted = False
        self.stopped = False

    async def take(self) -> BatchLine | None:
        async with self._lock:
            if not self._queue and not (self.stopped or self._exhausted):
                status = await self._lane.run(batch_status, batch_id=self._batch.pk)
                if status != Batch.Status.IN_PROGRESS or timezone.now() >= self._batch.expires_at:
                    self.stopped = True
                else:
                    rows = await self._lane.run(
                        batch_lines_pending, batch_id=self._batch.pk, after=self._after, limit=self._chunk
                    )
                    self._queue.extend(rows)
                    self._exhausted = not rows
                    self._after = rows[-1].line_number if rows else self._after
            return self._queue.popleft() if self._queue and not self.stopped else None


async def _sender(run: _Run, lines: _PendingLines, deadline: float) -> None:
    while time.monotonic() < deadline and (line := await lines.take()) is not None:
        replicas = await _idle_ready_replicas(run, deadline)
        if replicas is None:
            return  # the slice is over; the line stays pending for the next
        await _send_line(run, line, replicas)


async def _idle_ready_replicas(run: _Run, deadline: float) -> tuple | None:
    """The model's ready replicas that interactive traffic leaves idle, once there are any; None
    if the slice ends first. A model scaled to zero is woken, and its lines wait for it."""
    while time.monotonic() < deadline:
        model = await run.routing.model(run.batch.model_name)
        if model is None or not model.ready:
            await run.lane.run(deployment_wake, model_id=run.model_id)
            await asyncio.sleep(min(run.config.retry_after_s, max(0.0, deadline - time.monotonic())))
            continue
        if idle := await _idle_replicas(run, model.ready):
            return idle
        await asyncio.sleep(_IDLE_POLL_S)  # interactive requests come first
    return None


async def _idle_replicas(run: _Run, replicas) -> tuple:
    """The replicas with fewer interactive requests in flight than BATCH_REPLICA_BUSY_AT."""
    counts = await run.shared.interactive_outstanding([replica.replica_id for replica in replicas])
    busy_at = settings.BATCH_REPLICA_BUSY_AT
    return tuple(replica for replica in replicas if counts.get(replica.replica_id, 0) < busy_at)


async def _fail_all(run: _Run, lines: list[BatchLine], code: str, message: str) -> None:
    for line in lines:
        await run.lane.run(
            batch_line_settle,
            line_id=line.pk,
            outcome=None,
            status_code=None,
            response=None,
            error={"code": code, "message": message},
            now=timezone.now(),
        )


async def _translated(run: _Run, line: BatchLine) -> tuple[str, dict, Responses | None]:
    """The replica's path and body for the line, with the dialect that translated it (if any). A
    dialect reads its store through its `gw`'s admit_lane and its caller's `tenant_id`: here, the
    runner's lane and the batch's tenant."""
    body = {**line.body, "stream": False}
    if run.batch.endpoint != _RESPONSES:
        return run.batch.endpoint, body, None
    dialect = Responses()
    raw = await dialect.translate(_dialect_gateway(run), _dialect_caller(run), json.dumps(body).encode())
    return "/v1/chat/completions", json.loads(raw), dialect


def _dialect_gateway(run: _Run) -> SimpleNamespace:
    return SimpleNamespace(admit_lane=run.lane)


def _dialect_caller(run: _Run) -> SimpleNamespace:
    return SimpleNamespace(tenant_id=run.batch.tenant_id)


async def _send_line(run: _Run, line: BatchLine, replicas) -> None:
    started = time.monotonic()
    try:
        path, body, dialect = await _translated(run, line)
    except GatewayError as refused:  # a request the dialect refuses (a missing previous response): not sent
        await run.lane.run(
            batch_line_settle,
            line_id=line.pk,
            outcome=None,
            status_code=refused.status,
            response=json.loads(refused.body()),
            error=None,
            now=timezone.now(),
        )
        return
    hold = await run.lane.run(
        batch_line_hold,
        line=line,
        tenant_id=run.batch.tenant_id,
        api_key_id=run.batch.api_key_id,
        model_id=run.model_id,
        price=run.price,
        now=timezone.now(),
    )
    if isinstance(hold, HoldRefused):
        await _fail_all(run, [line], "insufficient_quota", "The tenant's credit could not cover this request.")
        return
    status, payload, replica_id = await _answer(run, line, replicas, path, body)
    usage = (payload or {}).get("usage") or {} if status == 200 else {}
    if status == 200 and dialect is not None:
        payload = await dialect.answer(_dialect_gateway(run), _dialect_caller(run), payload)
    outcome = RequestOutcome(
        request_id=line.request_id,
        # Answered: charged, as an interactive answer is. The replica refusing the request (400)
        # or no replica answering: released unbilled, as for an interactive request.
        status=UsageRecord.Status.COMPLETED if status == 200 else None,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        cached_prompt_tokens=usage_cached_tokens(usage),
        completion_tokens=_count(usage.get("completion_tokens")),
        total_latency_ms=int((time.monotonic() - started) * 1000),
        gpu_time_s=usage.get("gpu_time_s"),
        replica_id=replica_id,
        batch=True,
        image_count=_image_count(path, body),
    )
    if status == 200:
        payload["model"] = run.batch.model_name
    error = None
    if status is None:
        error = {"code": "replica_unavailable", "message": "No replica could serve the request."}
    await run.lane.run(
        batch_line_settle,
        line_id=line.pk,
        outcome=outcome,
        status_code=status,
        response=payload,
        error=error,
        now=timezone.now(),
    )


async def _answer(
    run: _Run, line: BatchLine, replicas, path: str, request: dict
) -> tuple[int | None, dict | None, int | None]:
    """(status, JSON answer, replica) from the first replica that answers 200 or 400; (None, None,
    None) when none does."""
    body = json.dumps(request).encode()
    key = (
        ""
        if path == "/v1/embeddings"
        else affinity_key(request, path == "/v1/chat/completions", run.config.affinity_prefix_chars)
    )
    tried: set[int] = set()
    headers = {
        "authorization": f"Bearer {run.config.worker_token}",
        "content-type": "application/json",
        "x-request-id": line.request_id,
        **prefix_key_header(key),
        **run.tenancy,
    }
    while len(tried) < min(_ATTEMPTS, len(replicas)):
        candidates = [replica for replica in replicas if replica.replica_id not in tried]
        replica = await run.shared.pick(candidates, line.request_id, affinity_choice(key, candidates))
        tried.add(replica.replica_id)
        try:
            async with asyncio.timeout(run.config.request_timeout_s):
                response = await run.upstream.post(replica.endpoint_url, path, body, headers)
                data = await response.read()
            answer = json.loads(data)
            if response.status in (200, 400) and isinstance(answer, dict):
                await run.shared.finish(line.request_id, replica_id=replica.replica_id)
                return response.status, answer, replica.replica_id
            logger.warning(
                "batch line %s: replica %s answered %s", line.request_id, replica.replica_id, response.status
            )
        except (UpstreamError, TimeoutError, ValueError) as exc:
            logger.warning("batch line %s: replica %s failed: %s", line.request_id, replica.replica_id, exc)
        await run.shared.finish(line.request_id, replica_id=replica.replica_id, replica_failed=True)
    return None, None, None


def _image_count(path: str, body: dict) -> int:
    """Images a chat line carries (validated when the batch was), for its usage record."""
    if path != "/v1/chat/completions":
        return 0
    try:
        return len(parse_request(ChatCompletionRequest, body).images())
    except ProtocolError:  # the replica refused it too: no record is written
        return 0


def _count(value) -> int:
    return value if isinstance(value, int) and value >= 0 else 0
