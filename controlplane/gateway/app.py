"""The /v1 ASGI app (Starlette), mounted in front of Django by `controlplane.asgi` (`process_app`).

A lean app rather than Django views: the hot path does no ORM work in steady state (keys and
routes are cached, limits live in Redis) and the writes it must make are batched on database
threads. The process's Gateway is built at ASGI lifespan startup, so that its chores (taking over
background responses whose process died among them) run before any request comes; a server
without lifespan events, or a startup that could not build it, builds it on the first request.
"""

import asyncio
import functools
import logging
import time
import uuid
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controlplane.gateway import batch_api, completions
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.dialects import background
from controlplane.gateway.dialects import routes as dialects
from controlplane.gateway.errors import GatewayError, dependency_unavailable, model_not_found
from controlplane.gateway.openapi import openapi_document
from controlplane.gateway.process import Gateway
from controlplane.gateway.refusals import request_counted

logger = logging.getLogger(__name__)


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def build_app() -> Starlette:
    lock = asyncio.Lock()

    async def gateway() -> Gateway:
        if app.state.gateway is None:
            async with lock:
                if app.state.gateway is None:
                    gw = Gateway(GatewayConfig.from_settings())
                    gw.add_chore(background.keep_claims(gw))
                    app.state.gateway = gw
        return app.state.gateway

    def endpoint(handler):
        """`handler` with errors answered OpenAI's way; its requests go to the metrics and its
        refusals to the refusal log (a stream counts itself when it ends, see relay)."""

        async def run(request: Request) -> Response:
            request_id = new_request_id()
            started = time.monotonic()
            response = await answer(handler, request, request_id)
            if isinstance(response, Response):
                response.headers["openai-processing-ms"] = str(int((time.monotonic() - started) * 1000))
                # Its model, tenant and refusal as the handler noted them (completions.serve, keys.request_grant).
                counted(request, response, request_id, started)
            return response

        return run

    def counted(request: Request, response: Response, request_id: str, started: float) -> None:
        """Every answer of this app, a route's or the router's, goes to the metrics and, refused,
        to the refusal log through this one call."""
        gw = app.state.gateway
        request_counted(gw.refusals if gw else None, request, response, request_id, started)

    async def answer(handler, request: Request, request_id: str) -> Response:
        try:
            return await handler(await gateway(), request, request_id)
        except GatewayError as error:
            request.state.error = error
            return error.response(request_id)
        except Exception as exc:
            retry_after = app.state.gateway.config.retry_after_s if app.state.gateway else 1
            if (error := dependency_unavailable(exc, retry_after)) is not None:
                logger.warning("request %s: %s (%s)", request_id, error.message, type(exc).__name__)
                request.state.error = error
                return error.response(request_id)
            logger.exception("request %s failed", request_id)
            error = GatewayError(
                500,
                "The server had an error while processing your request.",
                type="server_error",
                code="internal_error",
            )
            request.state.error = error
            return error.response(request_id)

    def served(path: str):
        async def serve(gw: Gateway, request: Request, request_id: str):
            return await completions.serve(gw, request, request_id, path=path)

        return serve

    async def list_models(gw: Gateway, request: Request, request_id: str) -> Response:
        cards = await _visible_models(gw, request)
        return JSONResponse({"object": "list", "data": cards}, headers={"x-request-id": request_id})

    async def retrieve_model(gw: Gateway, request: Request, request_id: str) -> Response:
        name = request.path_params["model"]
        for card in await _visible_models(gw, request):
            if card["id"] == name:
                return JSONResponse(card, headers={"x-request-id": request_id})
        raise model_not_found(name)

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document())  # public, as OpenAI's own document is

    async def http_error(request: Request, exc: HTTPException) -> Response:
        """The router's refusals: an unknown /v1 path (404, no endpoint label) or a route asked
        with a method it does not take (405, its route's label)."""
        request_id, started = new_request_id(), time.monotonic()
        await gateway()  # its refusal log, even when this is the process's first request
        message = "Unknown endpoint." if exc.status_code == 404 else f"Method {request.method} is not allowed here."
        error = request.state.error = GatewayError(exc.status_code, message)
        response = error.response(request_id, exc.headers)
        counted(request, response, request_id, started)
        return response

    @asynccontextmanager
    async def lifespan(app):
        try:
            await gateway()
        except Exception:
            # A startup that raises stops the server: the first request builds it instead.
            logger.warning("could not start the gateway at startup; the first request will", exc_info=True)
        yield
        if app.state.gateway is not None:
            await app.state.gateway.aclose()

    app = Starlette(
        routes=[
            Route("/v1/models", endpoint(list_models)),
            Route("/v1/models/{model:path}", endpoint(retrieve_model)),
            *(Route(path, endpoint(served(path)), methods=["POST"]) for path in completions.ENDPOINTS),
            Route("/v1/responses", endpoint(dialects.create_response), methods=["POST"]),
            Route("/v1/responses/{response_id}", endpoint(dialects.retrieve_response), methods=["GET"]),
            Route("/v1/responses/{response_id}", endpoint(dialects.delete_response), methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", endpoint(dialects.cancel_response), methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", endpoint(dialects.list_input_items), methods=["GET"]),
            Route("/v1/messages", endpoint(dialects.create_message), methods=["POST"]),
            *(Route(path, endpoint(handler), methods=methods) for path, handler, methods in batch_api.ROUTES),
            Route("/v1/openapi.json", openapi),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.gateway = None
    return app


@functools.cache
def process_app() -> Starlette:
    """This process's one /v1 app: asgi mounts it in front of Django and the playground calls it
    in-process, so both share one key cache, routing table, rate limits and credit holds."""
    return build_app()


async def _visible_models(gw: Gateway, request: Request) -> list[dict]:
    """Models this key may use that can answer: a ready replica, or one can be started for a
    request (`selectors.ModelRoute.servable`)."""
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    return [
        {"id": m.public_name, "object": "model", "created": m.created, "owned_by": "gpuserve"}
        for m in await gw.routing.models()
        if grant.allows(m.model_id) and m.servable
    ]
