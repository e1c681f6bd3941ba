"""LLMEngine: vLLM's offline interface over the scheduler, the model runner and the detokenizers.

    engine = LLMEngine("/models/llama", device="cpu", dtype="float32")
    outputs = engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))

or request by request: add_request(), then step() until has_unfinished_requests() is False.
Bad input raises ValueError from add_request and leaves every other request running.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gpuworker.attention.backend import AttentionBackend
from gpuworker.engine.config import EngineConfig
from gpuworker.engine.context_length import resolve_max_model_len, with_context
from gpuworker.engine.detokenizer import IncrementalDetokenizer, check_stop_token
from gpuworker.engine.facts import EngineFacts
from gpuworker.engine.grammar_masks import GrammarMatchers
from gpuworker.engine.kv_cache_dtype import kv_cache_torch_dtype
from gpuworker.engine.latency import LatencyWindows
from gpuworker.engine.model_runner import ModelRunner, StepHandle
from gpuworker.engine.multimodal import ImageInput, MultimodalPrompt, locate_images, multimodal_rotary
from gpuworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepStats, TokenLogprob
from gpuworker.engine.parallel import Workers, parallel_context
from gpuworker.engine.prompt_scoring import token_logprobs
from gpuworker.engine.prompts import Prompt, PromptTokenizer, TokenizedPrompt
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.scheduler import ScheduledBatch, Scheduler
from gpuworker.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence, SequenceGroup, SequenceStatus
from gpuworker.engine.sizing import plan_sizes
from gpuworker.engine.structured_output import GrammarCache, StructuredOutput
from gpuworker.models.config import ModelConfig
from gpuworker.models.loader import load_model, load_model_config, load_tokenizer, resolve_dtype, with_quantization
from gpuworker.models.tensor_parallel import shard_config

logger = logging.getLogger(__name__)


class _Request:
    """The engine's side of a request: text state and timings next to the scheduler's group."""

    def __init__(
        self, group: SequenceGroup, prompt: str | None, detokenizers: list[IncrementalDetokenizer], arrival_time: float
    ) -> None:
        self.group = group
        self.prompt = prompt
        self.detokenizers = detokenizers
        self.logprobs: list[list[TokenLogprob] | None] = [
            [] if group.params.logprobs is not None else None for _ in group.seqs
        ]
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None


@dataclass
class _InFlight:
    handle: StepHandle
    # (sequence, position of its placeholder) per sampling entry, from Scheduler.advance.
    sampling: list[tuple[Sequence, int]]
    # When the step() call that scheduled and launched it began.
    launched_at: float


@dataclass
class _Received:
    batch: ScheduledBatch
    launched_at: float
    # (sequence, logprob entry, whether its grammar ended with this token) per new token.
    tokens: list[tuple[Sequence, TokenLogprob | None, bool]]


def _needs_sync(params: SamplingParams) -> bool:
    # Penalties read every generated token's value when the step is prepared.
    return params.has_penalties


class _StageClock:
    """`with clock("stage"):` adds the stage's seconds (device work included) to timings."""

    def __init__(self, timings: dict[str, float], device: str) -> None:
        self.timings, self.cuda = timings, device.startswith("cuda")

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.timings[stage] = round(self.timings.get(stage, 0.0) + time.perf_counter() - started, 4)


def _default_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA, the pure-torch reference elsewhere."""
    if device.type == "cuda":
        from gpuworker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from gpuworker.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


class LLMEngine:
    def __init__(self, model: str | Path, *, attn_backend: AttentionBackend | None = None, **config: Any) -> None:
        config = EngineConfig(model=str(model), **config)
        # With tensor parallelism this process is rank 0: the other ranks' processes start first and
        # load their shards alongside this one's (engine.parallel). A model that does not split
        # into that many ranks is refused before any process starts.
        self.workers = None
        if config.tensor_parallel_size > 1:
            shard_config(
                with_quantization(load_model_config(config.model), config.quantization),
                parallel_context(config, 0),
            )
            self.workers = Workers.start(config)
        try:
            self._build(config, attn_backend)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, attn_backend: AttentionBackend | None) -> None:
        """Start-up, stage by stage: the model's config checked, the weights loaded (the tokenizer
        meanwhile), the batch limits and the KV pool sized, the runner built, the warm-up run or
        deferred."""
        # Seconds per start-up stage, for /health and bench/load_time.py.
        self.load_timings: dict[str, float] = {}
        clock = _StageClock(self.load_timings, config.device)
        max_model_len, kv_dtype = self._read_model_config(config)
        if attn_backend is None:
            attn_backend = _default_attention_backend(self.device)
        # The tokenizer (and the import of transformers behind it: seconds) loads in a thread
        # while the weights stream in, which spend their time in system calls and copies.
        tokenizer_loading = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        tokenizer_future = tokenizer_loading.submit(engine_tokenizer, config)
        tokenizer_loading.shutdown(wait=False)
        model, free_device_bytes = self._load_weights(config, attn_backend, clock)
        rank_mc = self._size(config, max_model_len, kv_dtype, free_device_bytes)
        with clock("tokenizer_wait"):
            self.tokenizer = tokenizer_future.result()
        self.eos_token_ids = list(self.model_config.eos_token_ids) or (
            [self.tokenizer.eos_token_id]
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
            else []
        )
        self.scheduler = Scheduler(self.config)
        self.prompts = PromptTokenizer(self.tokenizer, self.model_config, self.config)
        self._start_runner(rank_mc, model, clock)
        self._warm_up_or_defer(clock)
        if self.workers is not None:
            with clock("workers_ready_wait"):
                self.workers.wait_ready()
        self._start_request_state()

    def _read_model_config(self, config: EngineConfig) -> tuple[int, torch.dtype]:
        """The model's config, device and dtype, checked before any weight is read. Returns the
        context asked for (or the model's) and the KV cache's dtype."""
        mc = with_quantization(load_model_config(config.model), config.quantization)
        self.model_config = mc
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, mc)
        # Refused here, before any weight is read, on a device that cannot run an FP8 cache.
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype, config.device)
        max_model_len = resolve_max_model_len(config, mc)
        self.model_config = with_context(mc, max_model_len)
        return max_model_len, kv_dtype

    def _load_weights(
        self, config: EngineConfig, attn_backend: AttentionBackend, clock: _StageClock
    ) -> tuple[torch.nn.Module, int | None]:
        """The model with its weights on the device, and the device memory left free after them on
        the rank with the least (None on CPU)."""
        if self.device.type == "cuda":
            with clock("cuda_init"):
                torch.cuda.init()
                torch.empty(0, device=self.device)
        parallel = self.workers.context if self.workers is not None else None
        with clock("weights"):
            model = load_model(
                self.model_config,
                device=self.device,
                dtype=self.dtype,
                attn_backend=attn_backend,
                load_format=config.load_format,
                seed=config.seed,
                parallel=parallel,
            )
        free_device_bytes = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free_device_bytes, _ = torch.cuda.mem_get_info(self.device)
        if self.workers is not None:
            with clock("workers_weights_wait"):
                # Every rank's pool has as many blocks: sized for the GPU with the least room.
                free = [free_device_bytes, *self.workers.free_device_bytes()]
                free_device_bytes = None if None in free else min(free)
        return model, free_device_bytes

    def _size(
        self, config: EngineConfig, max_model_len: int, kv_dtype: torch.dtype, free_device_bytes: int | None
    ) -> ModelConfig:
        """Resolve the config's batch limits, KV pool and context for the room left (self.config);
        returns the shapes this rank holds."""
        # The KV cache and the memory sizing count the heads this rank holds.
        rank_mc = shard_config(self.model_config, self.workers.context if self.workers is not None else None)
        sized = plan_sizes(
            config,
            rank_mc,
            element_size=self.dtype.itemsize,
            max_model_len=max_model_len,
            free_device_bytes=free_device_bytes,
            kv_element_size=kv_dtype.itemsize,
        )
        pool_tokens = sized.num_kv_blocks * config.block_size
        if config.max_model_len is None and pool_tokens < max_model_len:
            max_model_len = pool_tokens
            logger.warning("the KV pool holds %d tokens: max_model_len lowered to that", max_model_len)
        self.config = replace(sized, max_model_len=max_model_len)
        logger.info(
            "max_num_seqs %d%s, max_num_batched_tokens %d%s, KV pool %d tokens, max_model_len %d",
            self.config.max_num_seqs,
            "" if config.max_num_seqs else " (default)",
            self.config.max_num_batched_tokens,
            "" if config.max_num_batched_tokens else " (default)",
            pool_tokens,
            max_model_len,
        )
        return rank_mc

    def _start_runner(self, rank_mc: ModelConfig, model: torch.nn.Module, clock: _StageClock) -> None:
        """The model runner over the KV pool (and the other ranks' runners), its decode graphs captured
        unless deferred."""
        if self.workers is not None:
            self.workers.start_runners(self.config)
        with clock("kv_cache"):
            self.runner = ModelRunner(self.config, rank_mc, model, self.device, self.dtype, self.workers)
        if self.runner.graph_capture_s:
            self.load_timings["cuda_graphs"] = self.runner.graph_capture_s
            self.load_timings["kv_cache"] = round(self.load_timings["kv_cache"] - self.runner.graph_capture_s, 4)

    def _warm_up_or_defer(self, clock: _StageClock) -> None:
        # Triton compiles on first use: for the eager path before the first requests, as the graphs
        # are captured; with defer_warm_up both as the engine's first work after it is ready.
        self._deferred_warm_up: deque[tuple[str, Callable[[], object]]] = deque()
        # The workers warm up as they start, so the driver's warm-up cannot wait for the first idle step.
        if self.device.type == "cuda" and self.config.defer_warm_up and self.workers is None:
            self._deferred_warm_up.append(("warm_up", self.runner.warm_up))
            graphs = self.runner.decode_graphs
            if graphs is not None:
                self._deferred_warm_up.extend(("cuda_graphs", graphs.capture_next) for _ in graphs.pending)
        elif self.device.type == "cuda":
            with clock("warm_up"):
                self.runner.warm_up()

    def _start_request_state(self) -> None:
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._next_seq_id = 0
        self._generate_ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prefilled_tokens = 0  # prompt tokens computed (prefill chunks), for the load report
        # Wall time of the steps that computed prompt tokens: the prefill rate the load report gives
        # is tokens over this, how fast a queue drains, not over the clock (idle time counts not).
        self.prefill_time_s = 0.0
        # Recent TTFT and inter-token latency, for the server's /stats (and so the autoscaler).
        self.latency = LatencyWindows()
        self.last_step_stats: StepStats | None = None
        # The step launched but not yet completed (async scheduling), and the requests that
        # force synchronous steps while they run.
        self._inflight: _InFlight | None = None
        self._num_sync_requests = 0
        # The end of the last step's accounting: a step's time starts no earlier (with async
        # scheduling the next step is launched while the previous one is still being read).
        self._last_completion = 0.0
        # Wall time spent in step() calls that had a batch to run or to read: the engine's busy
        # time, which the requests' gpu_time_s add up to.
        self.busy_time_s = 0.0
        # Grammar matchers of constrained requests; built on the first such request.
        self.grammar_matchers: GrammarMatchers | None = None
        self._grammar_lock = threading.Lock()

    @property
    def facts(self) -> EngineFacts:
        """What a server reads of this engine: its limits, vocabulary and start-up timings so far."""
        return EngineFacts.of(self.config, self.model_config, self.load_timings)

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt | TokenizedPrompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        """images: preprocessed (engine.multimodal.preprocess_image), in prompt order; the prompt's
        token ids hold each image's placeholder expanded to its num_tokens (expand_image_tokens)."""
        prompt_text, prompt_ids = prompt if isinstance(prompt, TokenizedPrompt) else self.tokenize(prompt)
        self._add(request_id, prompt_text, prompt_ids, params, arrival_time, images)

    def _multimodal(self, prompt_ids: list[int], images: list[ImageInput] | None) -> MultimodalPrompt | None:
        """The request's images placed in its prompt; ValueError for a text-only model or runs of
        image tokens that do not match the images."""
        vision = self.model_config.vision
        if not images:
            return None
        if vision is None:
            raise ValueError(
                f"{self.config.model} ({self.model_config.architecture}) is a text-only model: it takes no images"
            )
        name = f"{self.config.model} ({self.model_config.architecture})"
        starts = locate_images(prompt_ids, images, vision.image_token_id, name)
        if not hasattr(vision, "mrope_section"):  # plain rotary; image tokens attend within their image
            budget = self.config.max_num_batched_tokens
            if any(image.num_tokens > budget for image in images):
                raise ValueError(f"{name}: an image's tokens must fit in one step (max_num_batched_tokens {budget})")
            return MultimodalPrompt(list(images), starts, whole_images=True)
        positions, delta = multimodal_rotary(len(prompt_ids), images, starts, vision.spatial_merge_size)
        return MultimodalPrompt(list(images), starts, positions, delta)

    def _add(
        self,
        request_id: str,
        prompt_text: str | None,
        prompt_ids: list[int],
        params: SamplingParams | None,
        arrival_time: float | None,
        images: list[ImageInput] | None = None,
    ) -> None:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # The request's one admission check, before anything is built for it (Scheduler.add trusts it).
        self.scheduler.check_admissible(len(prompt_ids), params.max_tokens, params.n)
        vocab_size = self.model_config.vocab_size
        if params.logit_bias and (outside := [t for t in params.logit_bias if t >= vocab_size]):
            raise ValueError(f"logit_bias: token id {outside[0]} is not in [0, {vocab_size})")
        grammar = None
        if params.structured_output is not None:
            grammar = self._grammar_matchers().compile(params.structured_output)
        multimodal = self._multimodal(prompt_ids, images)
        max_tokens = params.max_tokens or self.config.max_model_len - len(prompt_ids)
        group = SequenceGroup(
            request_id, prompt_ids, params, next(self._arrivals), max_tokens, first_seq_id=self._next_seq_id
        )
        group.multimodal = multimodal
        self._next_seq_id += params.n
        detokenizers = [IncrementalDetokenizer(self.tokenizer, len(prompt_ids), params) for _ in group.seqs]
        self.scheduler.add(group)
        if grammar is not None:
            self.grammar_matchers.add(group, grammar)
        self._requests[request_id] = _Request(
            group, prompt_text, detokenizers, time.time() if arrival_time is None else arrival_time
        )
        if _needs_sync(params):
            self._num_sync_requests += 1

    def compile_grammar(self, structured: StructuredOutput) -> None:
        """Compile (or find cached) a request's grammar; ValueError if it is not usable. Safe to
        call from another thread, so a server can compile a new schema (hundreds of ms) without
        stalling the engine loop, whose add_request then finds it in the cache."""
        self._grammar_matchers().compile(structured)

    def _grammar_matchers(self) -> GrammarMatchers:
        """self.grammar_matchers, built on the first call."""
        with self._grammar_lock:
            if self.grammar_matchers is None:
                if self.tokenizer is None:
                    raise ValueError("structured_output: this model has no tokenizer to build grammars over")
                grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
                self.grammar_matchers = GrammarMatchers(grammars, pin_memory=self.device.type == "cuda")
            return self.grammar_matchers

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> TokenizedPrompt:
        """Text to token ids, or token ids checked against the vocabulary; ValueError for bad input.
        Safe to call from another thread: it only reads the tokenizer and the model config."""
        return self.prompts.tokenize(prompt, add_special_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output (None if unknown)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._forget(request)
        self.scheduler.abort(request.group)
        for seq in request.group.seqs:
            # A token still in flight never arrives for an aborted sequence.
            while seq.num_output_tokens and seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                seq.token_ids.pop()
        request.finish_time = time.time()
        return self._output(request, {})

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any; the engine runs no step after this."""
        if self.workers is not None:
            self.workers.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def has_deferred_warm_up(self) -> bool:
        """Kernels to compile or CUDA graphs to capture still (EngineConfig.defer_warm_up)."""
        return bool(self._deferred_warm_up)

    def do_deferred_warm_up(self) -> None:
        """Do one piece of the deferred warm-up: step() does one before each step until none is
        left, and an idle AsyncLLMEngine calls it, so it is done whether or not requests come.
        Until it is, a step's kernels may compile as it runs and a decode batch pads up to a
        captured graph or runs eagerly: slower, never wrong."""
        stage, work = self._deferred_warm_up.popleft()
        started = time.perf_counter()
        try:
            work()
        except Exception:  # every batch still runs eagerly; a broken capture must not stop serving
            logger.exception("deferred %s failed; the remaining graphs are not captured", stage)
            self._deferred_warm_up.clear()
        key = f"{stage}_deferred"
        self.load_timings[key] = round(self.load_timings.get(key, 0.0) + time.perf_counter() - started, 4)
        if not self._deferred_warm_up:
            logger.info(
                "deferred warm-up done: %s",
                ", ".join(f"{k} {v:.2f}s" for k, v in self.load_timings.items() if k.endswith("_deferred")),
            )

    def held_block_hashes(self, block_hashes: list[int]) -> list[int]:
        """Those of block_hashes whose blocks are cached on either KV tier (block_manager.last_block_hash)."""
        block_manager = self.scheduler.block_manager
        return [block_hash for block_hash in block_hashes if block_manager.holds(block_hash)]

    def score_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 (float64, on the host): a text scored by this
        engine's model and kernels (engine.prompt_scoring), for perplexity. The engine must be idle."""
        if self._requests:
            raise RuntimeError("score_tokens runs between requests: this engine has requests in flight")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed max_model_len {self.config.max_model_len}")
        return token_logprobs(self.runner, token_ids)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    def serving_figures(self) -> dict[str, Any]:
        """Live figures for a server's /stats, read between steps: batch and KV pool, cumulative
        counters, and TTFT / inter-token p95 over the last minute (None without a sample)."""
        scheduler = self.scheduler
        bm = scheduler.block_manager
        counters = scheduler.waiting.counters
        return {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "host_cache_hits": bm.host_cache_hits,
            "num_preemptions": scheduler.num_preemptions,
            "num_generated_tokens": self.num_generated_tokens,
            # Weighted tokens (prompt 1, output 2, recomputation included) served per tenant and
            # priority class, as [tenant, priority, tokens] (a list, for the JSON of /stats), and
            # the weight each tenant last came with.
            "tenant_service": [[*key, tokens] for key, tokens in counters.served.items()],
            "tenant_weights": dict(counters.weight),
            "num_prefilled_tokens": self.num_prefilled_tokens,
            "prefill_time_s": self.prefill_time_s,
            "waiting_tokens": sum(
                max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                for seqs in (scheduler.waiting, scheduler.running)
                for seq in seqs
            ),
            **self.latency.figures(),
        }

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that produced tokens or finished.

        With async scheduling the outputs are those of the step launched by the previous call:
        this call schedules and launches the next step first, so its host work overlaps the
        device work of the one before.
        """
        if self._deferred_warm_up:
            self.do_deferred_warm_up()
        started = time.perf_counter()
        outputs = self._step(started)
        if self._inflight is not None or self._last_completion >= started:  # launched or read a step
            self.busy_time_s += time.perf_counter() - started
        return outputs

    def _step(self, started: float) -> list[RequestOutput]:
        overlap = self.config.use_async_scheduling and self._num_sync_requests == 0
        outputs: list[RequestOutput] = []
        if not overlap and self._inflight is not None:
            outputs += self._process(self._receive(self._inflight))
        host_kv = self.runner.host_kv
        if host_kv is not None:
            self._land_restores(host_kv.landed())
        batch = self.scheduler.schedule()
        if host_kv is not None:
            host_kv.copy(*self.scheduler.block_manager.take_pending_copies())
        handle = None
        # Constrained rows sample only after their grammars have seen the previous step's tokens:
        # the forward is launched first, and the mask is built on the host while it runs.
        constrained = self.grammar_matchers is not None and self.grammar_matchers.any_constrained(
            [e.seq for e in batch.seqs if e.samples]
        )
        if not batch.is_empty:
            handle = self.runner.launch(
                batch, self._inflight.handle if self._inflight else None, defer_sampling=constrained
            )
        received = self._receive(self._inflight) if self._inflight is not None else None
        if constrained:
            # Only the grammars had to see the previous tokens: the mask goes out, and the sampling
            # with it, before their stop checks and text below. (Filling it on a worker thread
            # during those was measured slower: the two contend; BENCHMARKS.md, "Constrained
            # decoding".)
            self.runner.sample(handle, self.grammar_matchers.bitmask(handle.sample_seqs))
        if received is not None:
            # Stop checks and text of the previous step's tokens (filled in by _receive, so
            # advance() below hashes only known tokens).
            outputs += self._process(received)
        if handle is None:
            if host_kv is not None and host_kv.has_in_flight:
                # Only restores are left to wait for: the next step admits their sequences.
                self._land_restores(host_kv.wait())
                return outputs
            if received is None and not outputs and self.scheduler.has_unfinished:
                # Cannot happen while the pool holds max_model_len tokens; fail rather than spin.
                raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
            return outputs
        self._inflight = _InFlight(handle, self.scheduler.advance(batch), started)
        if not overlap:
            outputs += self._process(self._receive(self._inflight))
        return outputs

    def _land_restores(self, seq_ids: list[int]) -> None:
        block_manager = self.scheduler.block_manager
        for seq_id in seq_ids:
            block_manager.restore_landed(seq_id)

    def _receive(self, inflight: _InFlight) -> _Received:
        """Wait for a launched step's tokens, put them in place of their placeholders, and feed the
        constrained ones to their grammars."""
        self._inflight = None
        result = self.runner.wait(inflight.handle)
        rows = inflight.handle.row_of()
        tokens: list[tuple[Sequence, TokenLogprob | None, bool]] = []
        token_ids, logprobs = result.token_ids, result.logprobs
        for seq, position in inflight.sampling:
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted while the step ran
            row = rows[seq.seq_id]
            token_id = seq.token_ids[position] = token_ids[row]
            grammar_ended = seq.group.params.structured_output is not None and self.grammar_matchers.accept(
                seq, token_id
            )
            tokens.append((seq, logprobs[row], grammar_ended))
        return _Received(inflight.handle.batch, inflight.launched_at, tokens)

    def _process(self, received: _Received) -> list[RequestOutput]:
        """Stop checks and detokenization of a received step's tokens; the requests' outputs."""
        batch = received.batch
        deltas: dict[str, dict[int, tuple[str, list[int]]]] = {}
        now = time.time()
        observed_at = time.monotonic()
        latency = self.latency
        requests = self._requests
        num_generated = 0
        for seq, logprob, grammar_ended in received.tokens:
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted since
            group = seq.group
            request = requests[group.request_id]
            delta = self._process_token(request, seq, logprob, grammar_ended)
            num_generated += 1
            if request.first_token_time is None:
                request.first_token_time = now
                latency.time_to_first_token.add(now - request.arrival_time, observed_at)
            elif request.last_token_time < now:  # once a step per request (n > 1 adds n tokens)
                latency.inter_token.add(now - request.last_token_time, observed_at)
            request.last_token_time = now
            if group.params.output_kind == "final_only" and seq.status is not SequenceStatus.FINISHED:
                continue  # nobody reads this request's outputs before it finishes
            deltas.setdefault(group.request_id, {})[seq.index] = delta
        tokens_per_request: dict[str, int] = {}
        # The step's wall time, from its scheduling (or the end of the step before it) to its
        # tokens checked: shared out below before any finished request reports its figures.
        finished_at = time.perf_counter()
        duration = finished_at - max(received.launched_at, self._last_completion)
        self._last_completion = finished_at
        per_token = duration / batch.num_batched_tokens
        for seq, _, num_new, _ in batch.seqs:
            group = seq.group
            group.gpu_time_s += per_token * num_new
            request_id = group.request_id
            tokens_per_request[request_id] = tokens_per_request.get(request_id, 0) + num_new
        self.num_generated_tokens += num_generated
        prefilled = batch.num_batched_tokens - batch.num_decode_seqs
        self.num_prefilled_tokens += prefilled
        if prefilled:
            self.prefill_time_s += duration
        outputs = []
        for request_id, request_deltas in deltas.items():
            request = requests[request_id]
            if request.group.is_finished:
                self._forget(request)
                request.finish_time = now
            elif request.group.params.output_kind == "final_only":
                continue
            outputs.append(self._output(request, request_deltas))
        self.last_step_stats = self._stats(batch, duration, tokens_per_request, num_generated)
        return outputs

    def _forget(self, request: _Request) -> None:
        del self._requests[request.group.request_id]
        if request.group.params.structured_output is not None:
            self.grammar_matchers.remove(request.group)
        if _needs_sync(request.group.params):
            self._num_sync_requests -= 1

    def _process_token(
        self, request: _Request, seq: Sequence, logprob: TokenLogprob | None, grammar_ended: bool = False
    ) -> tuple[str, list[int]]:
        """Stop checks and detokenization for seq's new token; returns (text delta, token delta)."""
        params = request.group.params
        token_ids = seq.token_ids
        token_id = token_ids[-1]
        num_output_tokens = len(token_ids) - seq.num_prompt_tokens
        if logprob is not None:
            request.logprobs[seq.index].append(logprob)
        detokenizer = request.detokenizers[seq.index]
        finish = check_stop_token(token_id, num_output_tokens, params, self.eos_token_ids, request.group.max_tokens)
        if grammar_ended and (finish is None or finish[0] != "stop"):
            # The grammar took a stop token, which it allows only where the output is complete
            # (also before min_tokens and with ignore_eos: nothing could follow it).
            finish = ("stop", None)
        if finish is not None and finish[0] == "stop":
            detokenizer.finish(token_ids[:-1])  # an EOS or stop token adds no text
        else:
            stop_string = detokenizer.add_tokens(token_ids, check_stop=num_output_tokens >= params.min_tokens)
            if stop_string is not None:
                finish = ("stop", stop_string)
            elif finish is not None:
                detokenizer.finish(token_ids)
        if finish is not None:
            self.scheduler.finish(seq, *finish)
        return detokenizer.release(final=finish is not None), [token_id]

    def _output(self, request: _Request, deltas: dict[int, tuple[str, list[int]]]) -> RequestOutput:
        group = request.group
        delta = group.params.output_kind == "delta"
        completions = []
        for seq, detokenizer, logprobs in zip(group.seqs, request.detokenizers, request.logprobs):
            delta_text, delta_ids = deltas.get(seq.index, ("", []))
            if delta:  # one logprob entry per token, the step's at the end
                text, token_ids = delta_text, delta_ids
                logprobs = logprobs[len(logprobs) - len(delta_ids) :] if logprobs is not None else None
            else:
                text, token_ids = detokenizer.released_text, seq.output_token_ids
                logprobs = list(logprobs) if logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=token_ids,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=logprobs,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                )
            )
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            first_scheduled_time=group.first_scheduled_time,
            finish_time=request.finish_time,
            gpu_time_s=group.gpu_time_s,
            num_preemptions=group.num_preemptions,
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=request.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.is_finished,
            num_cached_tokens=group.num_cached_tokens,
            metrics=metrics,
        )

    def _stats(
        self, batch: ScheduledBatch, duration: float, tokens_per_request: dict[str, int], num_generated: int
    ) -> StepStats:
        block_manager = self.scheduler.block_manager
        decode_tokens = batch.num_decode_seqs
        return StepStats(
            duration_s=duration,
            num_prefill_tokens=batch.num_batched_tokens - decode_tokens,
            num_decode_tokens=decode_tokens,
            tokens_per_request=tokens_per_request,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=block_manager.usage,
            prefix_cache_queries=block_manager.prefix_cache_queries,
            prefix_cache_hits=block_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_generated_tokens=num_generated,
        )

    # -- offline conveniences -------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        images: list[list[ImageInput] | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion; outputs come back in input order.
        images: per prompt, its images (as add_request takes them) or None."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run_all([self.tokenize(prompt) for prompt in prompts], params, images)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run_all([self.render_chat(conversation) for conversation in conversations], params)

    def render_chat(
        self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> TokenizedPrompt:
        """One conversation (and OpenAI function tools) through the model's chat template."""
        return self.prompts.render_chat(conversation, tools)

    def _run_all(
        self,
        prompts: list[TokenizedPrompt],
        params: SamplingParams | list[SamplingParams] | None,
        images: list[list[ImageInput] | None] | None = None,
    ) -> list[RequestOutput]:
        all_images = images if images is not None else [None] * len(prompts)
        if len(all_images) != len(prompts):
            raise ValueError(f"images: got {len(all_images)} lists for {len(prompts)} prompts")
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        if len(all_params) != len(prompts):
            raise ValueError(f"params: got {len(all_params)} for {len(prompts)} prompts")
        # Only the final outputs are returned: no per-step output objects are built.
        all_params = [replace(p or SamplingParams(), output_kind="final_only") for p in all_params]
        batch_id = next(self._generate_ids)
        request_ids = [f"generate-{batch_id}-{i}" for i in range(len(prompts))]
        try:
            for request_id, (text, ids), request_params, request_images in zip(
                request_ids, prompts, all_params, all_images
            ):
                self._add(request_id, text, ids, request_params, None, request_images)
        except ValueError:
            for request_id in request_ids:
                self.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        while len(finished) < len(request_ids):
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]


def engine_tokenizer(config: EngineConfig):
    """The tokenizer of the engine `config` describes (None for bare dummy-weight configs)."""
    directory = Path(config.model)
    if (
        config.load_format == "dummy"
        and not (directory / "tokenizer.json").is_file()
        and not (directory / "tokenizer.model").is_file()
    ):
        return None  # benchmarks of bare configs work on token ids
    return load_tokenizer(directory)
