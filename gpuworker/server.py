"""The worker's OpenAI-compatible HTTP server: one engine replica behind Starlette, like `vllm serve`.

    app = build_app(ServerConfig(model="/models/llama", device="cuda"))
    run_server(ServerConfig(...), host="127.0.0.1", port=8100)   # uvicorn, draining on SIGTERM

The server answers before the model is loaded (GET /health says 503 "loading" with progress) so
the daemon and operators can watch. POST /drain or SIGTERM stops new requests (503) and lets
in-flight ones finish until the drain timeout; streams still running then end with an error event.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gpuworker.engine import SamplingParams
from gpuworker.engine_holder import EngineHolder, ServerConfig
from gpuworker.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, new_id, now, parse_request
from gpuworker.serving import Responder, drain_expired_error, engine_error, error_response, plan_chat

__all__ = ["ServerConfig", "build_app", "run_server"]

logger = logging.getLogger(__name__)

# After the drain deadline aborted what was left, responses get this long to reach their clients.
DRAIN_GRACE_S = 5.0
MAX_DRAIN_TIMEOUT_S = 3600.0


class _CountInFlight:
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


def build_app(config: ServerConfig) -> Starlette:
    holder = EngineHolder(config)

    def unauthorized(request: Request) -> JSONResponse | None:
        if not config.token:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {config.token}".encode()):
            return None
        return error_response("missing or wrong bearer token", 401, type="authentication_error",
                              code="invalid_api_key")

    def not_ready() -> JSONResponse | None:
        if holder.state == "ready":
            return None
        if holder.draining:
            return error_response("this replica is draining and takes no new requests", 503,
                                  type="service_unavailable", code="replica_draining")
        return error_response(f"the model is {holder.state}" + (f": {holder.error}" if holder.error else ""), 503,
                              type="service_unavailable")

    async def health(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        if holder.state == "ready":
            return JSONResponse({"status": "ready"})
        body: dict[str, Any] = {"status": holder.state}
        if holder.state == "loading":
            body["progress"] = holder.load_progress
        if holder.error:
            body["error"] = holder.error
        return JSONResponse(body, status_code=503)

    async def stats(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        return JSONResponse(await holder.snapshot())

    async def metrics(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        await holder.snapshot()
        return Response(holder.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def drain(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        try:
            body = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError as exc:
            return error_response(f"request body is not valid JSON: {exc}")
        timeout_s = body.get("timeout_s", config.drain_timeout_s) if isinstance(body, dict) else None
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 <= timeout_s <= MAX_DRAIN_TIMEOUT_S:
            return error_response(f"timeout_s must be a number of seconds in [0, {MAX_DRAIN_TIMEOUT_S:g}], "
                                  f"got {timeout_s!r}", param="timeout_s")
        holder.begin_drain(float(timeout_s))
        return JSONResponse({"running": holder.in_flight})

    async def models(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        card = {"id": config.model_name, "object": "model", "created": now(), "owned_by": "gpuworker",
                "root": config.model}
        if holder.engine is not None:
            card["max_model_len"] = holder.engine.engine.config.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        if (unavailable := not_ready()) is not None:
            return unavailable
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as exc:
            return error_response(f"request body is not valid JSON: {exc}")
        engine = holder.engine
        prompt: Any
        tool_parsing = None
        try:
            parsed = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
            if chat:  # the prompt, constraints and tool-call format come from the model
                plan = plan_chat(engine.engine, parsed)
                prompt, params, tool_parsing = plan.prompt_token_ids, plan.params, plan.tool_parsing
            else:
                prompt, params = parsed.prompt, SamplingParams(**parsed.sampling_kwargs())
        except ProtocolError as exc:
            return JSONResponse(exc.to_dict(), status_code=exc.status)
        except ValueError as exc:
            return engine_error(exc, "messages" if chat else "prompt")
        request_id = new_id("chatcmpl" if chat else "cmpl")
        stream = engine.generate(prompt, params, request_id)
        try:
            first = await anext(stream)
        except ValueError as exc:
            return engine_error(exc, "messages" if chat else "prompt")
        except StopAsyncIteration:  # pragma: no cover - the engine always yields a final output
            return error_response("the engine returned nothing", 500, type="server_error")
        if holder.drain_expired and not first.finished:  # admitted just as the drain deadline passed
            await engine.abort(request_id)
        responder = Responder(holder, parsed, request_id, chat, engine.engine.tokenizer, tool_parsing)
        if parsed.stream:
            return StreamingResponse(responder.sse(first, stream, request), media_type="text/event-stream")
        final = await _collect_unless_disconnected(request, first, stream)
        if final is None:
            await engine.abort(request_id)  # when this returns, its KV blocks are free
            return Response(status_code=499)
        if holder.drain_expired and final.finish_reason == "abort":
            error = drain_expired_error(holder.drain_timeout_s)
            return JSONResponse(error.to_dict(), status_code=error.status)
        holder.record_finished(final)
        return JSONResponse(responder.full(final))

    async def on_startup() -> None:
        holder.start_loading()

    async def on_shutdown() -> None:
        await asyncio.to_thread(holder.shutdown)

    @asynccontextmanager
    async def lifespan(app):
        await on_startup()
        try:
            yield
        finally:
            await on_shutdown()

    app = Starlette(routes=[
        Route("/health", health), Route("/stats", stats), Route("/metrics", metrics),
        Route("/drain", drain, methods=["POST"]),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], lifespan=lifespan, middleware=[Middleware(_CountInFlight, holder=holder)])
    app.state.holder = holder
    return app


async def _collect_unless_disconnected(request: Request, first, stream):
    """The request's final output, or None if the client went away first (a non-streaming client
    sends nothing more, so its disconnect is only seen by waiting for it alongside the engine)."""

    async def collect():
        final = first
        if not first.finished:
            async for output in stream:
                final = output
        return final

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


class _DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT and only then stops; a second one stops now."""

    def __init__(self, config: uvicorn.Config, holder: EngineHolder) -> None:
        super().__init__(config)
        self.holder = holder
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._drain_started or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._drain_started = True
        # A signal handler may not touch the loop directly: hand the drain over to it.
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        self.holder.begin_drain(self.holder.config.drain_timeout_s)
        await self.holder.wait_drained(DRAIN_GRACE_S)
        self.should_exit = True


class _QuietPolls(logging.Filter):
    """Drops access-log lines of /health and /stats, which the daemon polls twice a second."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and args[2] in ("/health", "/stats"))


def run_server(config: ServerConfig, *, host: str, port: int, log_level: str = "info") -> None:
    logging.getLogger("uvicorn.access").addFilter(_QuietPolls())
    app = build_app(config)
    server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                            timeout_graceful_shutdown=int(DRAIN_GRACE_S)), app.state.holder)
    server.run()
