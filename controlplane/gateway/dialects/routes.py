"""The routes of the Responses and Messages APIs: POSTs go through the chat path
(completions.serve) with their dialect; the stored responses are read and deleted here."""

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from controlplane.gateway import completions
from controlplane.gateway.dialects import background
from controlplane.gateway.dialects.anthropic_messages import AnthropicError, AnthropicMessages
from controlplane.gateway.dialects.responses import Responses
from controlplane.gateway.errors import GatewayError, bad_request, dependency_unavailable
from controlplane.gateway.process import Gateway
from controlplane.gateway.request_body import read_body
from controlplane.gateway.stored_responses import stored_response_cancel, stored_response_delete, stored_response_get

logger = logging.getLogger(__name__)

_CHAT = "/v1/chat/completions"
MAX_INPUT_ITEMS_PAGE = 100


async def create_response(gw: Gateway, request: Request, request_id: str) -> Response:
    try:
        raw = await read_body(request, gw.config.max_request_bytes)
    except GatewayError:
        await gw.keys.note_refused_grant(request, request.headers.get("authorization"))  # whose refusal it is
        raise
    if background.asks_background(raw):
        return await background.start(gw, request, raw, request_id)
    request = background.replayed(request, raw, request.receive)
    return await completions.serve(gw, request, request_id, path=_CHAT, dialect=Responses())


async def create_message(gw: Gateway, request: Request, request_id: str) -> Response:
    try:
        response = await completions.serve(gw, request, request_id, path=_CHAT, dialect=AnthropicMessages())
    except GatewayError as error:
        raise AnthropicError(error) from None
    except Exception as exc:  # answered as app.endpoint answers it, in Anthropic's shape
        error = dependency_unavailable(exc, gw.config.retry_after_s)
        if error is None:
            logger.exception("request %s failed", request_id)
            error = GatewayError(500, "The server had an error while processing your request.", type="server_error")
        raise AnthropicError(error) from None
    response.headers["request-id"] = request_id  # Anthropic's name for it
    return response


async def _stored(gw: Gateway, request: Request):
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    response_id = request.path_params["response_id"]
    stored = await gw.admit_lane.run(stored_response_get, tenant_id=grant.tenant_id, response_id=response_id)
    if stored is None:  # another tenant's response is as unknown as one never made
        raise GatewayError(404, f"Response with id {response_id!r} not found.", code="response_not_found")
    return grant, stored


async def retrieve_response(gw: Gateway, request: Request, request_id: str) -> Response:
    _, stored = await _stored(gw, request)
    return JSONResponse(stored.response, headers={"x-request-id": request_id})


async def delete_response(gw: Gateway, request: Request, request_id: str) -> Response:
    grant, stored = await _stored(gw, request)
    await gw.admit_lane.run(stored_response_delete, tenant_id=grant.tenant_id, response_id=stored.id)
    body = {"id": stored.id, "object": "response.deleted", "deleted": True}
    return JSONResponse(body, headers={"x-request-id": request_id})


async def cancel_response(gw: Gateway, request: Request, request_id: str) -> Response:
    grant, stored = await _stored(gw, request)
    if not stored.background:
        raise bad_request("Only a background response can be cancelled.", code="not_background")
    stored = await gw.admit_lane.run(stored_response_cancel, tenant_id=grant.tenant_id, response_id=stored.id)
    return JSONResponse(stored.response, headers={"x-request-id": request_id})


async def list_input_items(gw: Gateway, request: Request, request_id: str) -> Response:
    _, stored = await _stored(gw, request)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order: asc or desc", param="order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_INPUT_ITEMS_PAGE:
        raise bad_request(f"limit: a number from 1 to {MAX_INPUT_ITEMS_PAGE}", param="limit")
    items = list(stored.input_items) if order == "asc" else list(reversed(stored.input_items))
    if after := query.get("after"):
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[: int(limit)]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
    return JSONResponse(body, headers={"x-request-id": request_id})
