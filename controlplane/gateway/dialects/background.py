"""Background responses (`background: true`): checked, stored "queued" and answered at once; the
request then runs through the chat path in this gateway process as if its client stayed, and its
row follows it to its end. POST .../cancel marks the row cancelled, which the request sees within
a second as its client leaving: stopped, and billed by the same rule as a client that left
(charged as cancelled once its replica generated a token, released unbilled before).
A gateway process that stops takes its background requests with it; the sweep marks them failed.
"""

import asyncio
import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from controlplane.gateway import completions
from controlplane.gateway.dialects.responses import Responses
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.process import Gateway
from controlplane.gateway.stored_responses import (
    RUNNING,
    stored_response_finish,
    stored_response_save,
    stored_response_status,
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
    queued = dialect.response("queued", [], None)
    await gw.admit_lane.run(
        stored_response_save,
        tenant_id=grant.tenant_id,
        response_id=dialect.id,
        input_items=dialect.items,
        history=dialect.history + dialect.items,
        response=queued,
        background=True,
    )

    async def until_cancelled():
        while True:
            await asyncio.sleep(_CANCEL_POLL_S)
            if await gw.admit_lane.run(stored_response_status, response_id=dialect.id) not in RUNNING:
                return {"type": "http.disconnect"}

    gw.spawn(_run(gw, replayed(request, raw, until_cancelled), request_id, dialect))
    return JSONResponse(queued, headers={"x-request-id": request_id})


async def _run(gw: Gateway, request: Request, request_id: str, dialect: Responses) -> None:
    try:
        await completions.serve(gw, request, request_id, path=_CHAT, dialect=dialect)  # its answer is stored
        return
    except GatewayError as error:
        failure = {"code": error.code or error.type, "message": error.message}
    except Exception:
        logger.exception("background response %s failed", dialect.id)
        failure = {"code": "server_error", "message": "The server had an error while processing the response."}
    failed = {**dialect.response("failed", [], None), "error": failure}
    await gw.admit_lane.run(
        stored_response_finish, tenant_id=dialect.tenant_id, response_id=dialect.id, history=None, response=failed
    )
