"""The replica's ASGI app: one engine replica behind Starlette, OpenAI-compatible, like `vllm serve`.

    app = build_app(ServerConfig(model="/models/llama", device="cuda"))

The app answers before the model is loaded (GET /health says 503 "loading" with progress) so the
daemon and operators can watch. POST /drain stops new requests (503) and lets in-flight ones finish
until the drain timeout; streams still running then end with an error event. Every route asks for
the worker token (BearerAuth); `server.py` runs the app in its own process.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gpuworker.contract.openai_api import (
    CACHED_PROMPT_TOKENS_HEADER,
    PROMPT_TOKENS_HEADER,
    ProtocolError,
    new_id,
    now,
)
from gpuworker.contract.prefix_keys import PREFIX_KEY_HEADER
from gpuworker.contract.tenancy import tenancy_fields
from gpuworker.engine.output_streams import EngineDeadError
from gpuworker.engine.outputs import join_deltas
from gpuworker.replica.embeddings import embeddings as serve_embeddings
from gpuworker.replica.engine_holder import EngineHolder, ServerConfig
from gpuworker.replica.images.preparing import prepare_images
from gpuworker.replica.responses import (
    Responder,
    drain_expired_error,
    engine_error,
    error_response,
    plan_request,
    with_image_tokens,
)

__all__ = ["ServerConfig", "build_app"]

MAX_DRAIN_TIMEOUT_S = 3600.0


class BearerAuth:
    """ASGI middleware: every HTTP request must carry 'Authorization: Bearer <worker token>'
    (the scheme in any case, as RFC 7235 has it)."""

    def __init__(self, app: Any, token: str | None) -> None:
        self.app = app
        self.expected = token.encode() if token else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.expected is None:
            await self.app(scope, receive, send)
            return
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        denied = error_response(
            "missing or wrong bearer token", 401, type="authentication_error", code="invalid_api_key"
        )
        await denied(scope, receive, send)


class CountInFlight:
    """ASGI middleware counting API requests until their response (stream included) is over."""

    def __init__(self, app: Any, holder: EngineHolder) -> None:
        self.app, self.holder = app, holder

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        self.holder.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.holder.in_flight -= 1


def _holder(request: Request) -> EngineHolder:
    return request.app.state.holder


def _not_ready(holder: EngineHolder) -> JSONResponse | None:
    holder.check_engine()
    if holder.state == "ready":
        return None
    if holder.draining:
        return error_response(
            "this replica is draining and takes no new requests",
            503,
            type="service_unavailable",
            code="replica_draining",
        )
    return error_response(
        f"the model is {holder.state}" + (f": {holder.error}" if holder.error else ""), 503, type="service_unavailable"
    )


async def health(request: Request) -> Response:
    holder = _holder(request)
    holder.check_engine()
    if holder.state == "ready":
        return JSONResponse(
            {
                "status": "ready",
                "load_started_at": holder.load_started_at,
                "load_timings": holder.load_timings,
                "limits": holder.engine_limits,
                "engine_pid": holder.engine_pid,
            }
        )
    body: dict[str, Any] = {"status": holder.state}
    if holder.state == "loading":
        body["progress"] = holder.load_progress
    if holder.error:
        body["error"] = holder.error
    return JSONResponse(body, status_code=503)


async def stats(request: Request) -> Response:
    return JSONResponse(await _holder(request).snapshot())


async def metrics(request: Request) -> Response:
    holder = _holder(request)
    await holder.snapshot()
    return Response(holder.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def drain(request: Request) -> Response:
    holder = _holder(request)
    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as exc:
        return error_response(f"request body is not valid JSON: {exc}")
    timeout_s = body.get("timeout_s", holder.config.drain_timeout_s) if isinstance(body, dict) else None
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 <= timeout_s <= MAX_DRAIN_TIMEOUT_S
    ):
        return error_response(
            f"timeout_s must be a number of seconds in [0, {MAX_DRAIN_TIMEOUT_S:g}], got {timeout_s!r}",
            param="timeout_s",
        )
    holder.begin_drain(float(timeout_s))
    return JSONResponse({"running": holder.in_flight})


async def request_status(request: Request) -> Response:
    """Whether the caller's request (its x-request-id) generated a first token here, and its prompt
    tokens and cached prompt tokens: a gateway whose client left before a whole answer bills and
    records it by them."""
    caller_request_id = request.path_params["request_id"]
    started = _holder(request).started(caller_request_id)
    return JSONResponse(
        {
            "request_id": caller_request_id,
            "started": started is not None,
            "prompt_tokens": started.prompt_tokens if started else 0,
            "cached_prompt_tokens": started.cached_prompt_tokens if started else 0,
        }
    )


async def models(request: Request) -> Response:
    holder = _holder(request)
    config = holder.config
    card = {"id": config.model_name, "object": "model", "created": now(), "owned_by": "gpuworker", "root": config.model}
    if holder.engine is not None:
        card["max_model_len"] = holder.engine.facts.max_model_len
    return JSONResponse({"object": "list", "data": [card]})


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def embeddings(request: Request) -> Response:
    holder = _holder(request)
    if (unavailable := _not_ready(holder)) is not None:
        return unavailable
    return await serve_embeddings(request, holder.embedder, holder.config.model_name)


async def _generate(request: Request, chat: bool) -> Response:
    holder = _holder(request)
    if (unavailable := _not_ready(holder)) is not None:
        return unavailable
    if holder.embedder is not None:
        return error_response(
            f"{holder.config.model_name!r} is an embedding model; use /v1/embeddings",
            param="model",
            code="wrong_model_kind",
        )
    raw = await request.body()
    engine = holder.engine
    try:
        # Off the event loop: parsing, the chat template and tokenization of a prompt of megabytes
        # take seconds, and this loop serves every other stream of the replica.
        plan = await asyncio.to_thread(plan_request, engine.prompts, raw, chat)
    except ProtocolError as exc:
        return JSONResponse(exc.to_dict(), status_code=exc.status)
    except ValueError as exc:
        return engine_error(exc, "messages" if chat else "prompt")
    parsed = plan.parsed
    try:
        images = await prepare_images(
            plan.images,
            model_name=holder.config.model_name,
            preprocess=holder.image_preprocessor,
            limits=holder.config.image_limits,
            pool=holder.image_pool,
        )
    except ProtocolError as exc:
        return JSONResponse(exc.to_dict(), status_code=exc.status)
    try:
        # Whose request it is, for the engine's fair scheduler (the gateway's headers).
        params = replace(plan.params, **tenancy_fields(request.headers))
    except ValueError as exc:
        return error_response(str(exc))
    prompt = plan.prompt
    if images:
        try:
            prompt = with_image_tokens(engine.prompts, prompt, images)
        except ValueError as exc:
            return engine_error(exc, "messages")
    request_id = new_id("chatcmpl" if chat else "cmpl")
    # A vision engine takes the preprocessed images with the prompt; a text-only one gets none.
    stream = engine.generate(prompt, params, request_id, **({"images": images} if images else {}))
    try:
        first = await anext(stream)
    except ValueError as exc:
        return engine_error(exc, "messages" if chat else "prompt")
    except EngineDeadError:  # its process died: the replica is failed now, and says so
        return _not_ready(holder) or error_response("the engine stopped", 503, type="service_unavailable")
    except StopAsyncIteration:  # pragma: no cover - the engine always yields a final output
        return error_response("the engine returned nothing", 500, type="server_error")
    if holder.drain_expired and not first.finished:  # admitted just as the drain deadline passed
        await engine.abort(request_id)
    holder.note_prefix(request.headers.get(PREFIX_KEY_HEADER), first.prompt_token_ids)
    if not parsed.stream:  # a stream's caller sees the first token itself
        holder.note_started(request.headers.get("x-request-id"), first)
    responder = Responder(holder, parsed, request_id, chat, engine.prompts.tokenizer, plan.tool_parsing)
    if parsed.stream:
        return StreamingResponse(
            responder.sse(first, stream, request),
            media_type="text/event-stream",
            headers={
                PROMPT_TOKENS_HEADER: str(len(first.prompt_token_ids)),
                CACHED_PROMPT_TOKENS_HEADER: str(first.num_cached_tokens),
            },
        )
    try:
        final = await _collect_unless_disconnected(request, first, stream)
    except EngineDeadError:
        return _not_ready(holder) or error_response("the engine stopped", 503, type="service_unavailable")
    if final is None:
        await engine.abort(request_id)  # when this returns, its KV blocks are free
        return Response(status_code=499)
    if holder.drain_expired and final.finish_reason == "abort":
        error = drain_expired_error(holder.drain_timeout_s)
        return JSONResponse(error.to_dict(), status_code=error.status)
    holder.record_finished(final, final.num_generated_tokens)
    # Detokenized logprobs, tool calls read out of the text and the JSON of a long answer: off the loop too.
    return await asyncio.to_thread(lambda: JSONResponse(responder.full(final)))


async def _collect_unless_disconnected(request: Request, first, stream):
    """The request's whole answer (its deltas joined), or None if the client went away first (a
    non-streaming client sends nothing more, so its disconnect is only seen by waiting for it
    alongside the engine)."""

    async def collect():
        outputs = [first]  # deltas (output_kind="delta"), joined once at the end
        if not first.finished:
            async for output in stream:
                outputs.append(output)
        return join_deltas(outputs)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collector, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()  # leaving the generator also asks the engine to abort
            await asyncio.wait({collector})
        await stream.aclose()
    return collector.result() if collector in done else None


ROUTES = [
    Route("/health", health),
    Route("/stats", stats),
    Route("/metrics", metrics),
    Route("/drain", drain, methods=["POST"]),
    Route("/requests/{request_id}", request_status),
    Route("/v1/models", models),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
]


def build_app(config: ServerConfig, holder: EngineHolder | None = None) -> Starlette:
    """The app over `holder` (a new one by default), which starts loading at startup if it has not."""
    holder = holder if holder is not None else EngineHolder(config)

    @asynccontextmanager
    async def lifespan(app):
        holder.start_loading()
        try:
            yield
        finally:
            await asyncio.to_thread(holder.shutdown)

    # Auth runs first, so a request without the token is neither counted nor read.
    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        middleware=[Middleware(BearerAuth, token=config.token), Middleware(CountInFlight, holder=holder)],
    )
    app.state.holder = holder
    return app
