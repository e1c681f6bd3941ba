"""Background responses (`background: true`): checked, stored "queued" and answered at once; the
request then runs through the chat path in this gateway process as if its client stayed, and its
row follows it to its end. POST .../cancel marks the row cancelled, which the request sees within
a second as its client leaving: stopped, and billed by the same rule as a client that left
(charged as cancelled once its replica generated a token, released unbilled before).
The process that runs a response holds a claim on its row, renewed while it runs; when the
process dies the claim runs out and another gateway process runs the response again from its
stored request, under the same request id, so that it is held and charged once
(`resume_orphans`); after GATEWAY_BACKGROUND_RUNS runs it is marked failed instead.
"""

import asyncio
import json
import logging

from django.conf import settings
from django.utils import timezone
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from controlplane.gateway import completions
from controlplane.gateway.dialects.responses import Responses
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.models import StoredResponse
from controlplane.gateway.process import Gateway
from controlplane.gateway.stored_responses import (
    BackgroundRun,
    stored_response_finish,
    stored_response_running,
    stored_response_save,
    stored_responses_claim,
    stored_responses_renew,
)

logger = logging.getLogger(__name__)

_CANCEL_POLL_S = 1.0
_CHAT = "/v1/chat/completions"


def asks_background(raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return False  # the request path says what is wrong with it
    return isinstance(body, dict) and body.get("background") is True


def replayed(request: Request, raw: bytes, receive_after) -> Request:
    """`request` with its body (already read) to be read again, then `receive_after`'s messages."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive_after()

    return Request(request.scope, receive)


async def start(gw: Gateway, request: Request, raw: bytes, request_id: str) -> Response:
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    dialect = Responses()
    await dialect.translate(gw, grant, raw)  # a bad request is refused now, not queued
    dialect.owner = gw.process_id
    queued = dialect.response("queued", [], None)
    await gw.admit_lane.run(
        stored_response_save,
        tenant_id=grant.tenant_id,
        response_id=dialect.id,
        input_items=dialect.items,
        history=dialect.history + dialect.items,
        response=queued,
        background=BackgroundRun(
            request=json.dumps(json.loads(raw)), api_key_id=grant.key_id, request_id=request_id, owner=gw.process_id
        ),
    )
    work = _run(gw, replayed(request, raw, _until_stopped(gw, dialect)), request_id, dialect, grant.tenant_id, queued)
    gw.spawn(work)
    return JSONResponse(queued, headers={"x-request-id": request_id})


async def keep_claims(gw: Gateway) -> None:
    """Forever: renew this process's claims on the background responses it runs, and take over
    those whose process died (`resume_orphans`)."""
    interval = settings.GATEWAY_BACKGROUND_LEASE_SECONDS / 3
    while True:
        await asyncio.sleep(interval)
        try:
            await gw.settle_lane.run(stored_responses_renew, owner=gw.process_id, now=timezone.now())
            await resume_orphans(gw)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.warning("could not renew or take over background responses", exc_info=True)


async def resume_orphans(gw: Gateway) -> list[str]:
    """Run again, in this process, the background responses whose process died (their claim ran
    out): from their stored request, under their key as it is now and their own request id, so
    that what the dead run held or was charged is this run's hold (HoldPlacer.adopt). The ids
    taken over."""
    claimed = await gw.settle_lane.run(stored_responses_claim, owner=gw.process_id, now=timezone.now())
    for stored in claimed:
        logger.warning("background response %s: its gateway process stopped; running it again", stored.id)
        gw.spawn(_resume(gw, stored))
    return [stored.id for stored in claimed]


async def _resume(gw: Gateway, stored: StoredResponse) -> None:
    dialect = Responses()
    dialect.id, dialect.owner = stored.id, gw.process_id
    dialect.created_at = stored.response.get("created_at", dialect.created_at)
    raw = stored.request.encode()
    request = replayed(Request(_resumed_scope()), raw, _until_stopped(gw, dialect))
    await gw.holds.adopt(stored.request_id)
    try:
        await _run(gw, request, stored.request_id, dialect, stored.tenant_id, stored.response, key_id=stored.api_key_id)
    finally:
        gw.holds.forget_adopted(stored.request_id)


def _resumed_scope() -> dict:
    """The HTTP scope of a request run again without its caller (no headers: its key is read by id)."""
    return {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/responses",
        "raw_path": b"/v1/responses",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "server": None,
        "client": None,
    }


def _until_stopped(gw: Gateway, dialect: Responses):
    """The request's `receive` once its body is read: a disconnect when the response was
    cancelled, or another process took it over, as if its client left."""

    async def receive():
        while True:
            await asyncio.sleep(_CANCEL_POLL_S)
            if not await gw.admit_lane.run(stored_response_running, response_id=dialect.id, owner=dialect.owner):
                return {"type": "http.disconnect"}

    return receive


async def _run(
    gw: Gateway,
    request: Request,
    request_id: str,
    dialect: Responses,
    tenant_id: int,
    queued: dict,
    key_id: int | None = None,
) -> None:
    """`key_id`: run again by another process, under that key's grant as it is now."""
    try:
        grant = None if key_id is None else await gw.keys.grant_for_id(key_id)
        # Its answer is stored by the dialect (Responses.keep).
        await completions.serve(gw, request, request_id, path=_CHAT, dialect=dialect, grant=grant)
        return
    except GatewayError as error:
        failure = {"code": error.code or error.type, "message": error.message}
    except Exception:
        logger.exception("background response %s failed", dialect.id)
        failure = {"code": "server_error", "message": "The server had an error while processing the response."}
    failed = {**queued, "status": "failed", "error": failure}
    await gw.admit_lane.run(
        stored_response_finish,
        tenant_id=tenant_id,
        response_id=dialect.id,
        history=None,
        response=failed,
        owner=dialect.owner,
    )
