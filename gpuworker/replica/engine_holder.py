"""One server's engine replica and its life cycle: loading (with progress), ready, draining, failed.

The HTTP server answers before the model is loaded, so the engine is built in a background thread
here; draining stops new requests, lets in-flight ones finish until a deadline, then aborts them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from operator import methodcaller
from pathlib import Path
from typing import Any, NamedTuple

import torch

from gpuworker.contract.heartbeat import MAX_TENANT_SHARES
from gpuworker.engine import start_engine
from gpuworker.engine.embedding_engine import EmbeddingEngine, is_sentence_encoder
from gpuworker.engine.engine_process_client import EngineProcess
from gpuworker.engine.multimodal import preprocess_request_image
from gpuworker.engine.output_streams import EngineDeadError, StreamingEngine
from gpuworker.engine.outputs import RequestOutput
from gpuworker.models.loader import report_load_progress
from gpuworker.replica.images import ImageLimits
from gpuworker.replica.images.pool import ImagePool
from gpuworker.replica.metrics import EngineMetrics
from gpuworker.replica.prefix_report import HeldPrefixes

logger = logging.getLogger(__name__)

# Share of /health's progress for the weights; building the KV pool and tokenizer take the rest.
WEIGHTS_PROGRESS_START, WEIGHTS_PROGRESS_END = 0.05, 0.9
# How many callers' started requests a replica remembers (see EngineHolder.note_started).
STARTED_REQUESTS_KEPT = 10_000


class StartedRequest(NamedTuple):
    """What a caller's whole-answer request that generated a first token took of its prompt, for a
    gateway whose client left before the answer (its usage never went out)."""

    prompt_tokens: int
    cached_prompt_tokens: int  # of those, read from the prefix cache (as a stream's header says)


# /stats without an engine to ask (loading, failed, or its process gone).
NO_ENGINE_FIGURES = {
    "running": 0,
    "waiting": 0,
    "kv_cache_usage": 0.0,
    "tokens_per_s": 0.0,
    "prefix_cache_hit_rate": 0.0,
    "host_cache_hit_rate": 0.0,
    "prefix_keys": [],
    "num_generated_tokens": 0,
    "waiting_tokens": 0,
    "prefill_tokens_per_s": 0.0,
    "ttft_p95_s": None,
    "itl_p95_s": None,
}


@dataclass
class ServerConfig:
    model: str
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    token: str | None = None
    max_model_len: int | None = None
    # True: a max_model_len past the model's max_position_embeddings is served, with a warning.
    allow_long_context: bool = False
    # None: chosen by the engine for the device and the model (gpuworker/engine/sizing.py).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # "fp8": quantize a float checkpoint at load (a quantized checkpoint needs nothing).
    quantization: str | None = None
    # "fp8": the KV cache in FP8 e4m3 (twice the cached tokens); "auto": the model's dtype.
    kv_cache_dtype: str = "auto"
    # The host KV tier's bytes (engine.host_tier); 0: none.
    host_kv_cache_bytes: int = 0
    # The order requests are admitted in (EngineConfig.scheduling): "fair" or "fcfs".
    scheduling: str = "fair"
    gpu_memory_utilization: float = 0.9
    # Ranks (GPUs of this host from `device`'s index on) the model is split over; the replica starts
    # the other ranks' processes itself and answers as one.
    tensor_parallel_size: int = 1
    # How a split MoE model joins its ranks' experts (engine.config.EXPERT_PARALLEL_MODES).
    expert_parallel: str = "all_reduce"
    # SIGTERM (or POST /drain without a timeout): in-flight requests get this long to finish.
    drain_timeout_s: float = 30.0
    # The engine steps in a process of its own (engine/engine_process_client.py), where the server's
    # work (HTTP, JSON, SSE) cannot slow its steps; False: in a thread of the server's process.
    engine_process: bool = False
    # Limits on a chat request's images, and the domains images may be fetched from (none: data:
    # URLs only).
    image_limits: ImageLimits = field(default_factory=ImageLimits)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


class TokenSnapshot(NamedTuple):
    """The engine's token counters at one /stats call."""

    at: float  # time.monotonic()
    generated: int
    prefilled: int
    prefill_time_s: float  # wall time of the steps that prefilled (LLMEngine.prefill_time_s)


def window_rates(window: list[TokenSnapshot]) -> tuple[float, float]:
    """(output tokens/s over the window's span, prompt tokens/s over the prefilling steps' time):
    the first is what the replica served; the second how fast it drains a prompt queue, which
    idle time in the window must not lower (0 where nothing was prefilled: no evidence)."""
    first, last = window[0], window[-1]
    span = last.at - first.at
    generated_per_s = (last.generated - first.generated) / span if span > 0 else 0.0
    prefill_time = last.prefill_time_s - first.prefill_time_s
    prefill_per_s = (last.prefilled - first.prefilled) / prefill_time if prefill_time > 0 else 0.0
    return generated_per_s, prefill_per_s


def _per_tenant(service: list) -> dict[str, float]:
    """The engine's [tenant, priority, tokens] rows summed per tenant."""
    per_tenant: dict[str, float] = {}
    for tenant, _priority, tokens in service:
        per_tenant[tenant] = per_tenant.get(tenant, 0.0) + tokens
    return per_tenant


def tenant_shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each tenant's share of the weighted tokens served between two readings, the busiest
    MAX_TENANT_SHARES tenants (an engine that restarted in between counts from zero)."""
    served = {tenant: tokens - before.get(tenant, 0.0) for tenant, tokens in after.items()}
    served = {tenant: tokens for tenant, tokens in served.items() if tokens > 0}
    total = sum(served.values())
    busiest = sorted(served, key=served.get, reverse=True)[:MAX_TENANT_SHARES]
    return {tenant: round(served[tenant] / total, 4) for tenant in busiest}


def vision_preprocessor(model_config: Any) -> Any:
    """The image pool's preprocessing callable(image, detail) for a model that takes images (its
    checkpoint's own image processor), picklable for the pool's processes; None for a text model."""
    if getattr(model_config, "vision", None) is None or model_config.model_path is None:
        return None
    return functools.partial(preprocess_request_image, model_config.model_path)


class EngineHolder:
    def __init__(self, config: ServerConfig, engine_process: EngineProcess | None = None) -> None:
        """`engine_process`: one started ahead (by `serve` or a spare) for config.engine_process."""
        self.config = config
        self.engine: StreamingEngine | None = None
        self._engine_process = engine_process
        # An encoder checkpoint (BERT family) is served by /v1/embeddings instead: then this is set
        # and `engine` stays None.
        self.embedder: EmbeddingEngine | None = None
        # A vision model's image preprocessing (`vision_preprocessor`, a picklable
        # callable(image, detail)), run in `image_pool`'s processes; None: the model is text-only.
        self.image_preprocessor: Any = None
        self.image_pool = ImagePool()
        self.state = "loading"  # loading -> ready | failed; any -> draining
        self.error: str | None = None
        self.load_progress = 0.0
        # Wall-clock time the engine started loading, and its stages' seconds once ready.
        self.load_started_at: float | None = None
        self.load_timings: dict[str, float] = {}
        # The engine's sizes once loaded (batch limits, context, KV pool), for /health and the log.
        self.engine_limits: dict[str, int] = {}
        self._load_thread: threading.Thread | None = None
        self.metrics = EngineMetrics(config.model_name)
        # HTTP requests on /v1 in progress (counted by the server's middleware), streams included.
        self.in_flight = 0
        # Set once the drain deadline passed: requests still running were aborted for that reason.
        self.drain_expired = False
        self.drain_timeout_s = config.drain_timeout_s
        self._drain_task: asyncio.Task | None = None
        # Cumulative engine counters already added to the Prometheus counters.
        self._seen = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "host_cache_hits": 0, "num_preemptions": 0}
        # The conversations served here, to report those whose KV is still held.
        self.held_prefixes = HeldPrefixes()
        self._seen_tenant_service: dict[tuple[str, str], float] = {}
        self._tokens_window: list[TokenSnapshot] = []
        # (time, weighted tokens served per tenant) over the last ~10 s of snapshots.
        self._service_window: list[tuple[float, dict[str, float]]] = []
        # The callers' ids (x-request-id) of recent whole-answer requests that generated a first
        # token: a gateway whose client left before the answer asks (GET /requests/{id}) to bill
        # by it. It asks at once, so a bounded window of the latest ones is enough.
        self._started: OrderedDict[str, StartedRequest] = OrderedDict()  # by the caller's request id

    def check_engine(self) -> None:
        """A ready replica whose engine process or tensor-parallel rank died can run no step: it
        turns failed, so the daemon reports it and the fleet replaces it, instead of failing every
        request it is sent."""
        if self.state != "ready" or self.engine is None:
            return
        failure = self.engine.failure()
        if failure:
            self.state, self.error = "failed", failure
            logger.error("replica failed: %s", self.error)

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid, when the engine runs in a process of its own."""
        return self.engine.engine_pid if self.engine is not None else None

    # -- loading --------------------------------------------------------------------------------

    def start_loading(self) -> None:
        """Start building the engine in a background thread; a second call does nothing."""
        if self._load_thread is None:
            self._load_thread = threading.Thread(target=self._load, name="engine-load", daemon=True)
            self._load_thread.start()

    def _on_weights_progress(self, fraction: float) -> None:
        self.load_progress = WEIGHTS_PROGRESS_START + (WEIGHTS_PROGRESS_END - WEIGHTS_PROGRESS_START) * fraction

    def _load(self) -> None:
        # Warm-up after ready: the replica is ready 1-2 s sooner on an 8B model (BENCHMARKS.md, "Load time").
        kwargs: dict[str, Any] = {
            "device": self.config.device,
            "defer_warm_up": True,
            "gpu_memory_utilization": self.config.gpu_memory_utilization,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "host_kv_cache_bytes": self.config.host_kv_cache_bytes,
            "scheduling": self.config.scheduling,
            "allow_long_context": self.config.allow_long_context,
        }
        if self.config.dtype != "auto" or self.config.device != "cpu":  # CPU keeps float32 by default
            kwargs["dtype"] = self.config.dtype
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "quantization",
            "tensor_parallel_size",
            "expert_parallel",
        ):
            if getattr(self.config, name) is not None:
                kwargs[name] = getattr(self.config, name)
        self.load_progress = WEIGHTS_PROGRESS_START
        self.load_started_at = time.time()
        started = time.perf_counter()
        engine_process, self._engine_process = self._engine_process, None
        try:
            if engine_process is not None and (
                not self.config.engine_process or is_sentence_encoder(self.config.model)
            ):
                engine_process.stop()  # started ahead, not wanted after all
                engine_process = None
            if is_sentence_encoder(self.config.model):
                self._load_embedder(started)
                return
            if self.config.engine_process:
                kwargs["process"] = engine_process or True
            with report_load_progress(self._on_weights_progress):
                engine = start_engine(self.config.model, **kwargs)
        except Exception as exc:  # reported through /health and /stats, not a crash loop
            logger.exception("loading %s failed", self.config.model)
            self.error = f"{type(exc).__name__}: {exc}"
            if self.state == "loading":
                self.state = "failed"
            return
        self.engine, self.load_progress = engine, 1.0
        self.image_preprocessor = vision_preprocessor(engine.prompts.model_config)
        if self.image_preprocessor is not None:
            self.image_pool.warm()
        self.load_timings = {**engine.facts.load_timings, "engine_s": round(time.perf_counter() - started, 4)}
        self.engine_limits = engine.facts.limits
        if self.state == "loading":  # a drain that began meanwhile wins
            self.state = "ready"
        quantization = engine.prompts.model_config.quantization
        logger.info(
            "model %s ready in %.2fs, %s weights: %s; %s",
            self.config.model_name,
            self.load_timings["engine_s"],
            quantization.label if quantization is not None else "float",
            ", ".join(f"{stage} {seconds:.2f}s" for stage, seconds in self.load_timings.items()),
            ", ".join(f"{name} {value}" for name, value in self.engine_limits.items()),
        )

    def _load_embedder(self, started: float) -> None:
        dtype = (
            torch.float32
            if self.config.dtype == "auto" and self.config.device == "cpu"
            else getattr(torch, "float16" if self.config.dtype == "auto" else self.config.dtype)
        )
        self.embedder = EmbeddingEngine(self.config.model, device=self.config.device, dtype=dtype)
        self.load_progress = 1.0
        self.load_timings = {"engine_s": round(time.perf_counter() - started, 4)}
        if self.state == "loading":
            self.state = "ready"
        logger.info("encoder %s ready in %.2fs", self.config.model_name, self.load_timings["engine_s"])

    def shutdown(self) -> None:
        self.image_pool.shutdown()
        if self._engine_process is not None:  # started ahead, never loaded
            self._engine_process.stop()
        if self.engine is not None:
            self.engine.shutdown()
        if self.embedder is not None:
            self.embedder.shutdown()

    # -- draining -------------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._drain_task is not None

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests from now on; abort the in-flight ones still running after timeout_s.
        A second call keeps the first deadline. Call on the server's event loop."""
        if self._drain_task is not None:
            return
        self.drain_timeout_s = timeout_s
        if self.state != "failed":
            self.state = "draining"
        logger.info("draining: %d request(s) in flight, %.1fs to finish", self.in_flight, timeout_s)
        self._drain_task = asyncio.get_running_loop().create_task(self._expire_after(timeout_s))

    async def _expire_after(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            logger.warning("drain timeout (%.1fs) passed: aborting %d request(s)", timeout_s, self.in_flight)
            self.drain_expired = True
            await self.abort_all()

    async def abort_all(self) -> None:
        if self.engine is not None:
            try:
                for request_id in await self.engine.call(methodcaller("unfinished_request_ids")):
                    await self.engine.abort(request_id)
            except EngineDeadError:
                pass  # nothing left running to abort

    async def wait_drained(self, grace_s: float) -> None:
        """Wait for the drain to end: no request in flight, or grace_s after the deadline aborted
        them (a client that stops reading must not hold the process forever)."""
        if self._drain_task is not None:
            await self._drain_task
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # -- callers' requests ----------------------------------------------------------------------

    def note_started(self, caller_request_id: str | None, first: RequestOutput) -> None:
        """`first`: the request's first output; its prompt was matched against the prefix cache
        when it was scheduled, so the cached count is final already."""
        if caller_request_id:
            self._started[caller_request_id] = StartedRequest(len(first.prompt_token_ids), first.num_cached_tokens)
            if len(self._started) > STARTED_REQUESTS_KEPT:
                self._started.popitem(last=False)

    def started(self, caller_request_id: str) -> StartedRequest | None:
        """What a started request took of its prompt; None if it never started here."""
        return self._started.get(caller_request_id)

    # -- figures --------------------------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        """Live engine figures, read by the engine loop between steps; also refreshes the gauges."""
        base = {
            "state": self.state,
            "error": self.error,
            "load_progress": self.load_progress,
            "in_flight": self.in_flight,
        }
        if self.engine is None:
            return {**base, **NO_ENGINE_FIGURES}
        try:
            figures = await self.engine.call(methodcaller("serving_figures"))
        except EngineDeadError:
            self.check_engine()
            return {**base, "state": self.state, "error": self.error, **NO_ENGINE_FIGURES}
        m = self.metrics
        m.num_requests_running.set(figures["running"])
        m.num_requests_waiting.set(figures["waiting"])
        m.kv_cache_usage.set(figures["kv_cache_usage"])
        for key, counter in (
            ("prefix_cache_queries", m.prefix_cache_queries),
            ("prefix_cache_hits", m.prefix_cache_hits),
            ("host_cache_hits", m.host_cache_hits),
            ("num_preemptions", m.num_preemptions),
        ):
            delta = figures[key] - self._seen[key]
            if delta > 0:
                counter.inc(delta)
            self._seen[key] = figures[key]
        for tenant, priority, served in figures["tenant_service"]:
            # A restarted engine counts from zero again: only growth is added.
            delta = served - self._seen_tenant_service.get((tenant, priority), 0.0)
            if delta > 0:
                m.count_tenant_service(tenant, priority, delta)
            self._seen_tenant_service[tenant, priority] = served
        for tenant, weight in figures["tenant_weights"].items():
            m.set_tenant_weight(tenant, weight)
        # tokens/s over the last ~10 s of snapshots
        t = time.monotonic()
        self._tokens_window = [entry for entry in self._tokens_window if t - entry.at < 10.0]
        generated, prefilled = figures["num_generated_tokens"], figures["num_prefilled_tokens"]
        self._tokens_window.append(TokenSnapshot(t, generated, prefilled, figures["prefill_time_s"]))
        tokens_per_s, prefill_per_s = window_rates(self._tokens_window)
        self._service_window = [(ts, s) for ts, s in self._service_window if t - ts < 10.0]
        self._service_window.append((t, _per_tenant(figures["tenant_service"])))
        queries = figures["prefix_cache_queries"]
        return {
            **base,
            "running": figures["running"],
            "waiting": figures["waiting"],
            "kv_cache_usage": figures["kv_cache_usage"],
            "tokens_per_s": tokens_per_s,
            "prefix_cache_hit_rate": figures["prefix_cache_hits"] / queries if queries else 0.0,
            "host_cache_hit_rate": figures["host_cache_hits"] / queries if queries else 0.0,
            "prefix_keys": await self._held_prefix_keys(),
            "num_generated_tokens": figures["num_generated_tokens"],
            "waiting_tokens": figures["waiting_tokens"],
            "prefill_tokens_per_s": prefill_per_s,
            "ttft_p95_s": figures["ttft_p95_s"],
            "itl_p95_s": figures["itl_p95_s"],
            "tenant_shares": tenant_shares(self._service_window[0][1], self._service_window[-1][1]),
        }

    def note_prefix(self, digest: str | None, prompt_token_ids: list[int]) -> None:
        """A request of the conversation the gateway named `digest` (its x-prefix-key) was admitted."""
        if self.engine is not None:
            self.held_prefixes.note(digest, prompt_token_ids, self.engine.facts.block_size)

    async def _held_prefix_keys(self) -> list[str]:
        hashes = self.held_prefixes.block_hashes()
        if not hashes:
            return []
        try:
            held = await self.engine.call(methodcaller("held_block_hashes", hashes))
        except EngineDeadError:
            return []
        return self.held_prefixes.report(held)

    def record_finished(self, output: RequestOutput, generated_tokens: int) -> None:
        """A finished request's figures: `output` its last, generated_tokens its whole answer's."""
        m, metrics = self.metrics, output.metrics
        m.prompt_tokens.inc(len(output.prompt_token_ids))
        m.generation_tokens.inc(generated_tokens)
        if metrics.first_scheduled_time is not None:
            m.request_queue_time.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
        if metrics.first_token_time is not None:
            m.time_to_first_token.observe(max(0.0, metrics.first_token_time - metrics.arrival_time))
        if metrics.finish_time is not None:
            m.e2e_request_latency.observe(max(0.0, metrics.finish_time - metrics.arrival_time))
