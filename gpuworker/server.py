"""The worker's OpenAI-compatible HTTP server: one engine replica behind Starlette, like `vllm serve`.

    app = build_app(ServerConfig(model="/models/llama", device="cuda"))
    uvicorn.run(app, port=8100)

The HTTP server answers before the model is loaded (GET /health says 503 "loading") so the daemon
and operators can watch progress; the engine is built in a background thread once the app starts.
Every request's usage also reports `gpu_time_s`, its share of engine step time, for pricing.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gpuworker.engine import AsyncLLMEngine, SamplingParams
from gpuworker.engine.outputs import RequestOutput
from gpuworker.metrics import EngineMetrics
from gpuworker.protocol import (ChatCompletionRequest, CompletionRequest, ProtocolError, new_id, now,
                                parse_request, usage_dict)

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    model: str
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    token: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


class EngineHolder:
    """The engine replica and its load state; loading runs in a thread so HTTP answers meanwhile."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: AsyncLLMEngine | None = None
        self.state = "loading"
        self.error: str | None = None
        self.load_progress = 0.0
        self.metrics = EngineMetrics(config.model_name)
        # Cumulative engine counters already added to the Prometheus counters.
        self._seen = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}
        self._tokens_window: list[tuple[float, int]] = []

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="engine-load", daemon=True).start()

    def _load(self) -> None:
        kwargs: dict[str, Any] = {"device": self.config.device,
                                  "gpu_memory_utilization": self.config.gpu_memory_utilization}
        if self.config.dtype != "auto" or self.config.device != "cpu":  # CPU keeps float32 by default
            kwargs["dtype"] = self.config.dtype
        if self.config.max_model_len is not None:
            kwargs["max_model_len"] = self.config.max_model_len
        try:
            self.engine = AsyncLLMEngine(self.config.model, **kwargs)
        except Exception as exc:  # reported through /health and /stats, not a crash loop
            logger.exception("loading %s failed", self.config.model)
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        self.load_progress, self.state = 1.0, "ready"
        logger.info("model %s ready", self.config.model_name)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    async def snapshot(self) -> dict[str, Any]:
        """Live engine figures, read on the engine thread between steps; also refreshes the gauges."""
        if self.engine is None:
            return {"state": self.state, "error": self.error, "load_progress": self.load_progress,
                    "running": 0, "waiting": 0, "kv_cache_usage": 0.0, "tokens_per_s": 0.0,
                    "prefix_cache_hit_rate": 0.0}

        def read(engine):
            scheduler = engine.scheduler
            bm = scheduler.block_manager
            return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                    "kv_cache_usage": bm.usage, "prefix_cache_queries": bm.prefix_cache_queries,
                    "prefix_cache_hits": bm.prefix_cache_hits, "num_preemptions": scheduler.num_preemptions,
                    "num_generated_tokens": engine.num_generated_tokens}

        figures = await self.engine.call(read)
        m = self.metrics
        m.num_requests_running.set(figures["running"])
        m.num_requests_waiting.set(figures["waiting"])
        m.kv_cache_usage.set(figures["kv_cache_usage"])
        for key, counter in (("prefix_cache_queries", m.prefix_cache_queries),
                             ("prefix_cache_hits", m.prefix_cache_hits),
                             ("num_preemptions", m.num_preemptions)):
            delta = figures[key] - self._seen[key]
            if delta > 0:
                counter.inc(delta)
            self._seen[key] = figures[key]
        # tokens/s over the last ~10 s of snapshots
        t = time.monotonic()
        self._tokens_window = [(ts, n) for ts, n in self._tokens_window if t - ts < 10.0]
        self._tokens_window.append((t, figures["num_generated_tokens"]))
        first_t, first_n = self._tokens_window[0]
        tokens_per_s = (figures["num_generated_tokens"] - first_n) / (t - first_t) if t > first_t else 0.0
        queries = figures["prefix_cache_queries"]
        return {"state": self.state, "error": self.error, "load_progress": self.load_progress,
                "running": figures["running"], "waiting": figures["waiting"],
                "kv_cache_usage": figures["kv_cache_usage"], "tokens_per_s": tokens_per_s,
                "prefix_cache_hit_rate": figures["prefix_cache_hits"] / queries if queries else 0.0}

    def record_finished(self, output: RequestOutput) -> None:
        m, metrics = self.metrics, output.metrics
        m.prompt_tokens.inc(len(output.prompt_token_ids))
        m.generation_tokens.inc(output.num_generated_tokens)
        if metrics.first_token_time is not None:
            m.time_to_first_token.observe(max(0.0, metrics.first_token_time - metrics.arrival_time))
        if metrics.finish_time is not None:
            m.e2e_request_latency.observe(max(0.0, metrics.finish_time - metrics.arrival_time))


def _error(message: str, status: int = 400, param: str | None = None, code: str | None = None,
           type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(ProtocolError(message, param=param, code=code, status=status, type=type).to_dict(),
                        status_code=status)


def _engine_error(exc: ValueError, prompt_field: str) -> JSONResponse:
    message = str(exc)
    code = "context_length_exceeded" if "max_model_len" in message else None
    param = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
    if code is not None:
        param = prompt_field if param is None else param
    return _error(message, param=param, code=code)


def build_app(config: ServerConfig) -> Starlette:
    holder = EngineHolder(config)

    def unauthorized(request: Request) -> JSONResponse | None:
        if not config.token:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {config.token}".encode()):
            return None
        return _error("missing or wrong bearer token", 401, type="authentication_error",
                      code="invalid_api_key")

    def not_ready() -> JSONResponse | None:
        if holder.state == "ready":
            return None
        return _error(f"the model is {holder.state}" + (f": {holder.error}" if holder.error else ""), 503,
                      type="service_unavailable")

    async def health(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        if holder.state == "ready":
            return JSONResponse({"status": "ready"})
        body = {"status": holder.state, "progress": holder.load_progress}
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
            return _error(f"request body is not valid JSON: {exc}")
        try:
            parsed = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
            params = SamplingParams(**parsed.sampling_kwargs())
        except ProtocolError as exc:
            return JSONResponse(exc.to_dict(), status_code=exc.status)
        except ValueError as exc:
            return _engine_error(exc, "messages" if chat else "prompt")
        engine = holder.engine
        tokenizer = engine.engine.tokenizer
        if chat:
            try:
                prompt: Any = engine.engine.render_chat(parsed.chat_messages())[1]
            except ValueError as exc:
                return _engine_error(exc, "messages")
        else:
            prompt = parsed.prompt
        request_id = new_id("chatcmpl" if chat else "cmpl")
        stream = engine.generate(prompt, params, request_id)
        try:
            first = await anext(stream)
        except ValueError as exc:
            return _engine_error(exc, "messages" if chat else "prompt")
        except StopAsyncIteration:  # pragma: no cover - the engine always yields a final output
            return _error("the engine returned nothing", 500, type="server_error")
        responder = _Responder(holder, parsed, request_id, chat, tokenizer)
        if parsed.stream:
            return StreamingResponse(responder.sse(first, stream, request), media_type="text/event-stream")
        final = first
        try:
            if not first.finished:
                async for output in stream:
                    final = output
                    if await request.is_disconnected():
                        await engine.abort(request_id)
                        return Response(status_code=499)
        finally:
            await stream.aclose()
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
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], lifespan=lifespan)
    app.state.holder = holder
    return app


class _Responder:
    """Turns engine outputs into OpenAI response bodies (whole or as SSE chunks)."""

    def __init__(self, holder: EngineHolder, parsed: Any, request_id: str, chat: bool, tokenizer: Any):
        self.holder, self.parsed, self.request_id, self.chat = holder, parsed, request_id, chat
        self.tokenizer = tokenizer
        self.created = now()
        self.object = "chat.completion" if chat else "text_completion"

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _logprobs(self, entries) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            def item(token_id, logprob):
                token = self._token(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
            return {"content": [{**item(e.token_id, e.logprob),
                                 "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]} for e in entries]}
        tokens = [self._token(e.token_id) for e in entries]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(t): lp for t, lp in e.top_logprobs} for e in entries],
                "text_offset": offsets}

    def _usage(self, output: RequestOutput) -> dict:
        return usage_dict(len(output.prompt_token_ids), output.num_generated_tokens,
                          prompt_tokens_details={"cached_tokens": output.num_cached_tokens},
                          gpu_time_s=output.metrics.gpu_time_s)

    def full(self, output: RequestOutput) -> dict:
        choices = []
        for c in output.outputs:
            logprobs = self._logprobs(c.logprobs)
            if self.chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                text = (output.prompt or "") + c.text if self.parsed.echo else c.text
                choices.append({"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
        return {"id": self.request_id, "object": self.object, "created": self.created,
                "model": self.holder.config.model_name, "choices": choices, "usage": self._usage(output)}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.request_id, "object": f"{self.object}.chunk" if self.chat else self.object,
                "created": self.created, "model": self.holder.config.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def sse(self, first: RequestOutput, stream: AsyncIterator[RequestOutput],
                  request: Request) -> AsyncIterator[str]:
        engine = self.holder.engine
        metrics = self.holder.metrics
        finished = False
        sent_logprobs = [0] * len(first.outputs)
        try:
            if self.chat:  # OpenAI opens every choice with the role
                yield self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None} for c in first.outputs])
            output = first
            last_time = time.monotonic()
            while True:
                choices = []
                for c in output.outputs:
                    if not c.delta_text and not c.delta_token_ids and c.finish_reason is None:
                        continue
                    logprobs = None
                    if c.logprobs is not None:
                        logprobs = self._logprobs(c.logprobs[sent_logprobs[c.index]:])
                        sent_logprobs[c.index] = len(c.logprobs)
                    if self.chat:
                        choices.append({"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                                        "logprobs": logprobs, "finish_reason": c.finish_reason})
                    else:
                        choices.append({"index": c.index, "text": c.delta_text, "logprobs": logprobs,
                                        "finish_reason": c.finish_reason})
                if choices:
                    yield self._chunk(choices)
                if output.finished:
                    finished = True
                    self.holder.record_finished(output)
                    if self.parsed.include_usage:
                        yield self._chunk([], usage=self._usage(output))
                    break
                output = await anext(stream)
                t = time.monotonic()
                metrics.inter_token_latency.observe(t - last_time)
                last_time = t
            yield "data: [DONE]\n\n"
        except ValueError as exc:
            yield f"data: {json.dumps(ProtocolError(str(exc)).to_dict())}\n\n"
        finally:
            if not finished:
                # Client gone (cancellation) or an error: free the request's KV blocks now. Not
                # awaited directly, because a cancelled task cannot await.
                asyncio.ensure_future(engine.abort(self.request_id))
            await stream.aclose()
