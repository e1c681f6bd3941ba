"""EngineConfig: every engine knob in one dataclass, validated once and passed down explicitly.

Four fields depend on the model and the device and may be left None by the user: `max_model_len`
(the model's max_position_embeddings), `num_kv_blocks` (sized from a memory budget), and the batch
limits `max_num_seqs` and `max_num_batched_tokens` (chosen for the device's memory and the model's
size, see sizing.py). The engine resolves them once at start-up with `dataclasses.replace`, which
validates again.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuworker.checkpoint_quantization import LOAD_QUANTIZATIONS

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")
# "auto": the model's dtype; "fp8": float8_e4m3fn with a scale per layer for keys and for values
# (engine.kv_cache_dtype), twice the blocks of a bf16 cache in the same memory.
KV_CACHE_DTYPES = ("auto", "fp8")
# How a MoE model split over tensor_parallel_size ranks (each holding num_experts / N experts) joins
# its ranks' experts:
# "all_reduce": every rank routes every token and computes the choices of its own experts; one
#   all-reduce sums the partial outputs (models.moe). One collective per layer, every rank reads
#   every token.
# "all_to_all": each rank routes its slice of the tokens and dispatches each (token, expert, weight)
#   to the expert's rank, which computes it and sends the result back; the slices are gathered
#   (models.expert_parallel). A token's hidden state goes only to its experts' ranks.
EXPERT_PARALLEL_MODES = ("all_reduce", "all_to_all")
# The order the scheduler admits waiting requests in (engine.fair_share): "fcfs" in arrival order;
# "fair" interactive before batch, and between tenants by the least weighted service so far.
SCHEDULING_POLICIES = ("fcfs", "fair")
# On CPU there is no "free device memory" to fill, so the KV pool gets a fixed budget by default.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    # None: size the pool from the memory budget below.
    num_kv_blocks: int | None = None
    # A model with sliding-window layers (Gemma 3): the blocks of those layers' own pool, where a
    # sequence holds only its window (engine.window_blocks). None: sized at start-up (sizing.py);
    # 0: no pool of their own, every layer keeps every token in the main pool.
    num_window_kv_blocks: int | None = None
    # The sliding layers' window, filled in at start-up from the model (None: no sliding layers).
    sliding_window: int | None = None
    # CUDA: the fraction of the device memory still free after loading the weights that the KV pool
    # and the activations may take.
    gpu_memory_utilization: float = 0.9
    # CPU: the KV pool's byte budget (None: DEFAULT_CPU_KV_CACHE_BYTES).
    kv_cache_memory_bytes: int | None = None
    # The host KV tier's byte budget (engine.host_tier): cached blocks evicted from the KV pool are
    # kept there (pinned memory on CUDA) and copied back on a prefix hit. 0: no host tier.
    host_kv_cache_bytes: int = 0
    # Its blocks, filled in at start-up from host_kv_cache_bytes (sizing.py).
    num_host_kv_blocks: int = 0
    # None: chosen at start-up for the device and the model (sizing.py).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # A prompt that fits in this share of max_num_batched_tokens is short: while one waits, long
    # prefills leave it that share of every step, and it may pass long prompts queued ahead of it
    # (scheduler.py). 0: plain arrival order.
    short_prefill_share: float = 0.125
    # "fair" policy: while an interactive request is running or waiting, batch requests' prefill
    # chunks (running ones and new admissions together) take at most this share of
    # max_num_batched_tokens in a step, so a step beside interactive work stays short; batch
    # decodes are not capped. With no interactive work, batch takes the whole step. 1: no cap.
    batch_prefill_share: float = 0.25
    # SCHEDULING_POLICIES. With one tenant and one class (requests that name neither) both admit
    # in arrival order.
    scheduling: str = "fair"
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # True: a max_model_len past the model's max_position_embeddings is served, with a warning
    # (engine.context_length); False refuses it.
    allow_long_context: bool = False
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    # "fp8": quantize a float checkpoint's projections to FP8 at load. None: as the checkpoint is
    # (a quantized checkpoint says so in its config.json).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # Read by the model runner: True keeps every step eager (no CUDA-graph capture).
    enforce_eager: bool = False
    # True: compile the eager path's kernels and capture the decode CUDA graphs after the engine
    # is ready, one piece between steps (LLMEngine.do_deferred_warm_up), not before; the replica
    # server sets it, so a replica is ready ~1-2 s sooner (BENCHMARKS.md, "Load time").
    defer_warm_up: bool = False
    # Schedule and launch step N+1 while step N runs on the device, so host work hides behind it.
    # None: on for CUDA, off for CPU (where nothing runs asynchronously to hide behind).
    async_scheduling: bool | None = None
    # Ranks the model is split over (engine.parallel): one process each, on consecutive GPUs from
    # `device`'s index on CUDA (NCCL), or CPU processes (gloo). 1: one process, no collectives.
    tensor_parallel_size: int = 1
    # EXPERT_PARALLEL_MODES; read only by MoE models split over ranks.
    expert_parallel: str = "all_reduce"
    # A collective that waits longer than this for another rank fails (a rank died or hung), so the
    # engine raises instead of hanging.
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path, got {self.model!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization not in LOAD_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {LOAD_QUANTIZATIONS}, got {self.quantization!r}")
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        _positive_int("block_size", self.block_size)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.expert_parallel not in EXPERT_PARALLEL_MODES:
            raise ValueError(f"expert_parallel must be one of {EXPERT_PARALLEL_MODES}, got {self.expert_parallel!r}")
        timeout = self.distributed_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, got {timeout!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_kv_blocks",
            "max_model_len",
            "kv_cache_memory_bytes",
            "sliding_window",
        ):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        for name in ("host_kv_cache_bytes", "num_host_kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.host_kv_cache_bytes and not self.enable_prefix_caching:
            raise ValueError("host_kv_cache_bytes needs enable_prefix_caching: the host tier holds cached blocks")
        if self.host_kv_cache_bytes and self.tensor_parallel_size > 1:
            raise ValueError("host_kv_cache_bytes is not supported with tensor_parallel_size > 1")
        blocks = self.num_window_kv_blocks
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0):
            raise ValueError(f"num_window_kv_blocks must be a non-negative integer, got {blocks!r}")
        share = self.short_prefill_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
            raise ValueError(f"short_prefill_share must be in [0, 1), got {share!r}")
        share = self.batch_prefill_share
        # Not 0: a batch prefill already running would then hold its seat and blocks without
        # progress for as long as interactive traffic lasts.
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"batch_prefill_share must be in (0, 1], got {share!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "defer_warm_up", "allow_long_context"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        if self.num_kv_blocks is not None and self.max_model_len is not None:
            capacity = self.num_kv_blocks * self.block_size
            # A lone sequence must always be able to reach max_model_len, or preemption could
            # loop forever on it.
            if capacity < self.max_model_len:
                raise ValueError(
                    f"num_kv_blocks ({self.num_kv_blocks}) x block_size ({self.block_size}) = {capacity} "
                    f"tokens cannot hold one sequence of max_model_len ({self.max_model_len}) tokens; "
                    "raise num_kv_blocks (or the memory budget) or lower max_model_len"
                )

    @property
    def window_pool(self) -> tuple[int, int] | None:
        """(window, blocks) of the sliding layers' own pool, or None where they have none."""
        if self.sliding_window is None or not self.num_window_kv_blocks:
            return None
        return self.sliding_window, self.num_window_kv_blocks

    @property
    def use_async_scheduling(self) -> bool:
        if self.async_scheduling is None:
            return self.device.startswith("cuda")
        return self.async_scheduling

    @property
    def is_resolved(self) -> bool:
        return None not in (self.num_kv_blocks, self.max_model_len, self.max_num_seqs, self.max_num_batched_tokens)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
