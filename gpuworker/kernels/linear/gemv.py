"""GEMV for decode-sized linear layers: out [M, N] = x [M, K] @ weight[N, K]^T (+ bias), M in 1..16.

At batch 1 a linear layer is a weight stream: every byte of the weight is read once and used M times,
so the kernel is about reading [N, K] at copy bandwidth. Each program owns BLOCK_N output rows and
walks their weight tile [BLOCK_N, BLOCK_K] along K with wide contiguous loads; optionally SPLIT_K
programs share the rows (more programs for N=4096), and the last of them to finish sums the fp32
partials, all in one launch. Two inner products: CUDA-core FMAs (best at M=1, where the tile is
accumulated elementwise and reduced once at the end) or tl.dot on a 16-row padded x (tensor cores,
for M >= 2). With silu_mul_input the down projection reads the gate_up output [M, 2K] directly.
With weight_scale the weight is FP8 (float8_e4m3fn, one float32 scale per output row), read as such
and widened in registers: half the bytes of bfloat16 per token (the FP8 linears' batch-1 path), with
its own tuned configs (bench/quant_gemv.py). Tuned configs per device: configs/gemv/<device>.json.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpuworker.kernels import configs
from gpuworker.kernels.device import gated_activation
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_operand,
    check_tensor,
    dot_options,
    lazy_jit,
    next_power_of_2,
    pdl_options,
    split_k_counters,
)
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE

MAX_M = 16
# tl.dot needs every dimension >= 16; x rows are padded to this.
_DOT_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    use_dot: bool = False
    # K tiles each program loads before it waits for the previous kernel (one-row FMA kernel without
    # split-K or fused input; see the kernel). Pays after a latency-bound kernel (attention), whose
    # run time the weight loads then overlap.
    prefetch: int = 0

    @property
    def name(self) -> str:
        kind = "dot" if self.use_dot else "fma"
        split = f"-s{self.split_k}k" if self.split_k > 1 else ""
        prefetch = f"-pf{self.prefetch}" if self.prefetch else ""
        return f"{kind}-n{self.block_n}-k{self.block_k}-w{self.num_warps}-p{self.num_stages}{split}{prefetch}"


# The candidates bench/gemv.py times on every shape. FMA tiles are 16 KB of bf16 per iteration (128 B
# per thread); num_stages > 1 makes Triton prefetch the next tiles through shared memory (for the FMA
# loop only because the loop is a tl.range with num_stages, see the kernel), 1 keeps loads direct.
CANDIDATES: tuple[GemvConfig, ...] = (
    GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=1),
    GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3),
    GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=1),
    GemvConfig(block_n=32, block_k=512, num_warps=8, num_stages=2),
    GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=1, split_k=4),
    # Two tiles (16 KB of bf16 per program, 64 registers per thread) held through the wait; four
    # measured slower as o_proj at batch 1 (BENCHMARKS.md, the o_proj config table).
    GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, prefetch=2),
    # BLOCK_N 64 is one wgmma tile on sm_90. At N=4096 that is only 64 programs for 132 SMs, hence the
    # split-K variants.
    GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True),
    GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=4, use_dot=True),
    GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, use_dot=True),
    GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=2, use_dot=True),
    GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=4, use_dot=True),
)
# One-row candidates for an FP8 weight (gemv's weight_scale), which bench/quant_gemv.py times beside
# the bf16 ones: a byte per weight, so wider K tiles keep 16 B or more per thread per load, and more
# split-K for N = 4096. At most 128 weights per thread per tile (the elementwise accumulator's
# registers).
FP8_CANDIDATES: tuple[GemvConfig, ...] = (
    GemvConfig(block_n=16, block_k=1024, num_warps=4, num_stages=1),
    GemvConfig(block_n=16, block_k=1024, num_warps=4, num_stages=3),
    GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=2),
    GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3),
    GemvConfig(block_n=8, block_k=2048, num_warps=4, num_stages=1),
    GemvConfig(block_n=8, block_k=2048, num_warps=8, num_stages=2),
    GemvConfig(block_n=4, block_k=2048, num_warps=4, num_stages=2),
    GemvConfig(block_n=32, block_k=1024, num_warps=8, num_stages=2),
    GemvConfig(block_n=16, block_k=1024, num_warps=4, num_stages=3, prefetch=1),
    GemvConfig(block_n=16, block_k=1024, num_warps=4, num_stages=1, split_k=2),
    GemvConfig(block_n=16, block_k=1024, num_warps=4, num_stages=3, split_k=4),
    GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3, split_k=2),
    GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=2, split_k=4),
    GemvConfig(block_n=32, block_k=512, num_warps=4, num_stages=3, split_k=4),
)
CANDIDATES_BY_NAME = {c.name: c for c in (*CANDIDATES, *FP8_CANDIDATES)}

# The configs measured on each device: configs/gemv/<device>.json, {(weight dtype, N, K, M bucket):
# candidate name}, M buckets 1, 2, 4, 8, 16 (M rounds up). A bfloat16 record exists only where the
# kernel beat cuBLAS (F.linear) on that shape (bench/gemv.py); the model layers use gemv exactly there
# (tuned_config) and F.linear elsewhere, so on a device without a file every layer takes cuBLAS. A
# float16 weight takes the bfloat16 records (the same bytes per weight; the sweep times bfloat16). An
# FP8 weight (float8_e4m3fn, gemv's weight_scale) takes its own records (bench/quant_gemv.py), else the
# bfloat16 one, else the default.
TABLE_KEY = ("weight_dtype", "n", "k", "m")
_SIXTEEN_BIT, _FP8 = "bfloat16", "float8_e4m3fn"

_DEFAULT_SINGLE_ROW = CANDIDATES_BY_NAME["fma-n16-k512-w4-p1"]
_DEFAULT_MULTI_ROW = CANDIDATES_BY_NAME["dot-n64-k128-w4-p4"]


def m_bucket(m: int) -> int:
    return next_power_of_2(m)


def _candidate(config: str) -> GemvConfig:
    """A table record's config, by candidate name."""
    if config not in CANDIDATES_BY_NAME:
        raise ValueError(f"gemv config {config!r} is not one of the candidates (CANDIDATES, FP8_CANDIDATES)")
    return CANDIDATES_BY_NAME[config]


def table_config(
    m: int, n: int, k: int, *, fp8_weight: bool = False, device: torch.device | None = None
) -> GemvConfig | None:
    """The config measured on `device` (None: the current one) for x [m, k] @ W[n, k]^T: an FP8
    weight's own record first, then the bfloat16 one; None where the device's table has neither."""
    table = configs.table("gemv", TABLE_KEY, device, _candidate)
    bucket = m_bucket(m)
    config = table.get((_FP8, n, k, bucket)) if fp8_weight else None
    return config if config is not None else table.get((_SIXTEEN_BIT, n, k, bucket))


def tuned_config(x: torch.Tensor, weight: torch.Tensor) -> GemvConfig | None:
    """The measured config for x @ weight^T if the kernel beat cuBLAS on that shape on x's GPU, else None."""
    if not x.is_cuda or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or x.shape[0] > MAX_M:
        return None
    return table_config(x.shape[0], weight.shape[0], weight.shape[1], device=x.device)


def pick_config(m: int, n: int, k: int, *, fp8_weight: bool = False, device: torch.device | None = None) -> GemvConfig:
    """The config for x [m, k] @ W[n, k]^T on `device`: table_config's, else a default."""
    config = table_config(m, n, k, fp8_weight=fp8_weight, device=device)
    if config is not None:
        return config
    # One row needs only one FMA per weight element; from two rows on, tensor cores keep the
    # arithmetic off the critical path.
    return _DEFAULT_SINGLE_ROW if m == 1 else _DEFAULT_MULTI_ROW


def _gemv_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    residual_ptr,
    norm_weight_ptr,
    residual_out_ptr,
    eps,
    best_value_ptr,
    best_index_ptr,
    argmax_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NORM_INPUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ARGMAX: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_W_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N-1 instead of being masked, so weight loads stay unpredicated and wide;
    # only the store is masked.
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
    ms = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Each split owns a contiguous run of whole K tiles, so only a K tail needs masks.
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    tile_start = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, k_tiles)
    if PREFETCH > 0:
        # The weights do not depend on the previous kernel: the first PREFETCH tiles are loaded into
        # registers before the wait (one row, no split, plain input, K >= PREFETCH * BLOCK_K: see
        # _launch), so under PDL they stream in while that kernel still runs.
        pre_ks = tl.arange(0, PREFETCH * BLOCK_K)
        w_pre = tl.load(w_rows + pre_ks[None, :], eviction_policy="evict_first")
        tile_start = PREFETCH
    if USE_PDL:  # see launch.pdl_options: wait for the previous kernel, then let the next one launch
        # (prefetching the first weight tiles of every GEMV into L2 before the wait was measured
        # slower: after a bandwidth-bound kernel the prefetch only competes with its tail)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PREFETCH > 0:
        x_pre = tl.load(x_ptr + pre_ks, eviction_policy="evict_last")
        acc += tl.sum(w_pre.to(tl.float32) * x_pre.to(tl.float32)[None, :], axis=1)[:, None]
    if not USE_DOT and BLOCK_M == 1:
        # Elementwise accumulation, one cross-thread reduction after the loop.
        acc_tile = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if NORM_INPUT:  # one row, one split: the program sees the whole row, so it sums its squares
            sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    # Triton pipelines loads that feed no tl.dot only in a loop carrying its own num_stages.
    for tile in tl.range(tile_start, tile_end, num_stages=NUM_STAGES):
        ks = tile * BLOCK_K + offs_k
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + ks[None, :], mask=ks[None, :] < K, other=0.0, eviction_policy="evict_first")
        if USE_DOT:
            acc = _dot_tile(acc, w, x_ptr, ms, ks, M, K, stride_xm, SILU_MUL, DOT_FP32, DOT_PRECISION)
        else:
            w32 = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x_mask = (ks < K) & (tl.full([BLOCK_K], m, tl.int32) < M)
                if SILU_MUL:
                    x_row = gated_activation.silu_and_mul(
                        tl.load(x_ptr + m * stride_xm + ks, mask=x_mask, other=0.0, eviction_policy="evict_last"),
                        tl.load(x_ptr + m * stride_xm + K + ks, mask=x_mask, other=0.0, eviction_policy="evict_last"),
                    )
                elif NORM_INPUT:
                    x_row, sum_sq = _norm_input(
                        x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, ks, x_mask, sum_sq, pid_n, HAS_RESIDUAL
                    )
                else:
                    x_row = tl.load(x_ptr + m * stride_xm + ks, mask=x_mask, other=0.0, eviction_policy="evict_last")
                if BLOCK_M == 1:
                    acc_tile += w32 * x_row.to(tl.float32)[None, :]
                else:
                    part = tl.sum(w32 * x_row.to(tl.float32)[None, :], axis=1)
                    acc += tl.where(ms[None, :] == m, part[:, None], 0.0)
    if not USE_DOT and BLOCK_M == 1:
        if NORM_INPUT:
            acc += tl.sum(acc_tile, axis=1)[:, None] * tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)
        else:
            acc += tl.sum(acc_tile, axis=1)[:, None]

    out_mask = (rows[:, None] < N) & (ms[None, :] < M)
    out_ptrs = out_ptr + ms[None, :] * stride_om + rows[:, None]
    if SPLIT_K == 1:
        acc = _scale_and_bias(acc, rows, N, w_scale_ptr, bias_ptr, HAS_W_SCALE, HAS_BIAS)
        out_values = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptrs, out_values, mask=out_mask)
        if ARGMAX:
            _argmax(
                out_values,
                rows,
                ms,
                pid_n,
                M,
                N,
                best_value_ptr,
                best_index_ptr,
                argmax_ptr,
                counter_ptr,
                BLOCK_N,
                BLOCK_M,
            )
    else:
        _sum_splits(
            acc,
            rows,
            ms,
            pid_n,
            pid_k,
            M,
            N,
            out_ptrs,
            out_mask,
            partial_ptr,
            counter_ptr,
            w_scale_ptr,
            bias_ptr,
            SPLIT_K,
            BLOCK_N,
            BLOCK_M,
            HAS_W_SCALE,
            HAS_BIAS,
        )


@triton.jit
def _dot_tile(
    acc, w, x_ptr, ms, ks, M, K, stride_xm, SILU_MUL: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """acc [BLOCK_N, BLOCK_M] plus the weight tile w [BLOCK_N, BLOCK_K] times the input's rows ms
    (padded to tl.dot's 16) at columns ks, on tensor cores (IEEE float32 FMAs where DOT_FP32)."""
    x_ptrs = x_ptr + ms[:, None] * stride_xm + ks[None, :]
    x_mask = (ms[:, None] < M) & (ks[None, :] < K)
    if SILU_MUL:
        x = gated_activation.silu_and_mul(
            tl.load(x_ptrs, mask=x_mask, other=0.0, eviction_policy="evict_last"),
            tl.load(x_ptrs + K, mask=x_mask, other=0.0, eviction_policy="evict_last"),
        )
    else:
        x = tl.load(x_ptrs, mask=x_mask, other=0.0, eviction_policy="evict_last")
    if DOT_FP32:
        acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _norm_input(
    x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, ks, x_mask, sum_sq, pid_n, HAS_RESIDUAL: tl.constexpr
):
    """(the input row's columns ks for w * (s * norm_weight), sum_sq plus their squares): RMSNorm of
    s = x + residual on the fly, scaled by 1 / rms after the loop. s is rounded to x's dtype like the
    unfused residual add (and written once, by the first column block, as the new residual stream);
    the normalised input is not rounded before the product."""
    x_row = tl.load(x_ptr + ks, mask=x_mask, other=0.0, eviction_policy="evict_last")
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + ks, mask=x_mask, other=0.0, eviction_policy="evict_last")
        x_row = (x_row.to(tl.float32) + res.to(tl.float32)).to(x_row.dtype)
        if pid_n == 0:  # the new residual stream, written once
            tl.store(residual_out_ptr + ks, x_row, mask=x_mask)
    s32 = x_row.to(tl.float32)
    sum_sq += s32 * s32
    gain = tl.load(norm_weight_ptr + ks, mask=x_mask, other=0.0, eviction_policy="evict_last")
    return s32 * gain.to(tl.float32), sum_sq


@triton.jit
def _scale_and_bias(acc, rows, N, w_scale_ptr, bias_ptr, HAS_W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (float32) times an FP8 weight's row scales, plus the bias."""
    if HAS_W_SCALE:
        acc = acc * tl.load(w_scale_ptr + rows, mask=rows < N, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _argmax(
    out_values,
    rows,
    ms,
    pid_n,
    M,
    N,
    best_value_ptr,
    best_index_ptr,
    argmax_ptr,
    counter_ptr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Each row's argmax over the stored (rounded) values out_values [BLOCK_N, BLOCK_M], first index
    on ties, NaN above everything as in torch.argmax: this program's best of its BLOCK_N columns,
    then the last program to finish reduces the per-program bests (ordering as for split-K)."""
    values = out_values.to(tl.float32)
    values = tl.where(values != values, float("inf"), values)
    values = tl.where(rows[:, None] < N, values, float("-inf"))
    num_blocks = tl.num_programs(0)
    best_ptrs = ms * num_blocks + pid_n
    tl.store(best_value_ptr + best_ptrs, tl.max(values, axis=0), mask=ms < M)
    local = tl.argmax(values, axis=0, tie_break_left=True)
    tl.store(best_index_ptr + best_ptrs, pid_n * BLOCK_N + local, mask=ms < M)
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1)
    if ticket == num_blocks - 1:
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        best_index = tl.zeros([BLOCK_M], dtype=tl.int32)
        for start in range(0, num_blocks, 256):
            blocks = start + tl.arange(0, 256)
            mask = (ms[:, None] < M) & (blocks[None, :] < num_blocks)
            ptrs = ms[:, None] * num_blocks + blocks[None, :]
            # .cg: from L2, never a line this SM cached before the other programs wrote it.
            chunk = tl.load(best_value_ptr + ptrs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            chunk_indices = tl.load(best_index_ptr + ptrs, mask=mask, other=0, cache_modifier=".cg")
            chunk_best = tl.max(chunk, axis=1)
            # Indices grow with the program, so the chunk's first maximum has the smallest.
            chunk_index = tl.min(tl.where(chunk == chunk_best[:, None], chunk_indices, 2147483647), axis=1)
            take = chunk_best > best  # an equal maximum in a later chunk comes after
            best = tl.where(take, chunk_best, best)
            best_index = tl.where(take, chunk_index, best_index)
        tl.store(argmax_ptr + ms, best_index.to(tl.int64), mask=ms < M)
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch


@triton.jit
def _sum_splits(
    acc,
    rows,
    ms,
    pid_n,
    pid_k,
    M,
    N,
    out_ptrs,
    out_mask,
    partial_ptr,
    counter_ptr,
    w_scale_ptr,
    bias_ptr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_W_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Split-K: this split's partial sums acc into partial [SPLIT_K, M, N] (float32); whoever draws
    the last ticket adds the splits in order (deterministic), scales, adds the bias and stores. The
    barrier orders every thread's partial stores before the (one-thread, acq_rel, gpu-scope)
    ticket, so the last one sees all partials."""
    part_ptrs = partial_ptr + ms[None, :] * N + rows[:, None]
    tl.store(part_ptrs + pid_k * M * N, acc, mask=out_mask)
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr + pid_n, 1)
    if ticket == SPLIT_K - 1:
        total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            # .cg: read from L2, never a line this SM cached before the other splits wrote it.
            total += tl.load(part_ptrs + split * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
        total = _scale_and_bias(total, rows, N, w_scale_ptr, bias_ptr, HAS_W_SCALE, HAS_BIAS)
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=out_mask)
        tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch


_gemv = lazy_jit(_gemv_kernel)


def _check_config(config: GemvConfig) -> None:
    for field in ("block_n", "block_k", "num_warps", "split_k"):
        value = getattr(config, field)
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"config.{field} must be a positive power of 2, got {value!r}")
    if config.use_dot and (config.block_n < 16 or config.block_k < 16):
        raise ValueError(f"a tl.dot config needs block_n and block_k >= 16, got {config.block_n}, {config.block_k}")
    if config.num_stages < 1:
        raise ValueError(f"config.num_stages must be >= 1, got {config.num_stages}")
    if config.prefetch and (not isinstance(config.prefetch, int) or config.prefetch & (config.prefetch - 1)):
        raise ValueError(f"config.prefetch must be 0 or a power of 2, got {config.prefetch!r}")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul_input: bool = False,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, accumulated in float32.

    weight_scale [N] float32: the weight is float8_e4m3fn and row n stands for weight[n] * scale[n];
    only with an FMA config (the one-row default), not tl.dot's.

    M <= 16; x, weight and bias share one dtype; last dimensions contiguous. With silu_mul_input, x is
    the gate_up output [M, 2K] and the input is silu_and_mul(x) (rounded to x's dtype as the unfused
    kernel rounds it). `config` defaults to pick_config(M, N, K). gemv_rms_norm fuses an RMSNorm
    into the input instead.
    """
    m, n, config = _checked(x, weight, bias, config, "gemv", silu_mul_input=silu_mul_input, weight_scale=weight_scale)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    _launch(x, weight, bias, out, config, silu_mul_input=silu_mul_input, weight_scale=weight_scale)
    return out


def _checked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
    caller: str,
    *,
    silu_mul_input: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> tuple[int, int, GemvConfig]:
    """Check a call's operands and row count; return M, N and the config (pick_config's if None)."""
    _check_operands(x, weight, bias, silu_mul_input=silu_mul_input, fp8_weight=weight_scale is not None)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if m > MAX_M:
        raise ValueError(f"x has {m} rows; {caller} handles at most {MAX_M} (use F.linear for larger batches)")
    if config is None:
        config = pick_config(m, n, k, fp8_weight=weight_scale is not None, device=x.device)
        if weight_scale is not None and config.use_dot:
            config = _DEFAULT_SINGLE_ROW
    _check_config(config)
    if weight_scale is not None:
        check_operand("weight_scale", weight_scale, (n,), torch.float32, x.device)
        if config.use_dot:
            raise ValueError(f"an FP8 weight needs an FMA config, not {config.name}")
    return m, n, config


def _check_operands(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu_mul_input: bool = False,
    fp8_weight: bool = False,
) -> None:
    """x [M, K] (or [M, 2K] for silu_mul_input), weight [N, K], bias [N]: one dtype (the weight FP8
    with fp8_weight) and device, last dimensions contiguous."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE if fp8_weight else x.dtype,), device=device)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    width = x.shape[1]
    n, k = weight.shape
    expected_width = 2 * k if silu_mul_input else k
    if width != expected_width:
        what = "2 * weight's K (gate then up)" if silu_mul_input else "weight's K"
        raise ValueError(f"x's last dimension must be {what} = {expected_width}, got {width}")
    if bias is not None:
        check_operand("bias", bias, (n,), x.dtype, device)


def _launch(x, weight, bias, out, config, *, silu_mul_input=False, norm=None, argmax=None, weight_scale=None) -> None:
    """norm: (residual or None, norm_weight, residual_out, eps) for gemv_rms_norm; argmax: [M] int64
    for gemv_argmax (SPLIT_K 1); weight_scale: [N] float32 for an FP8 weight."""
    m, k, n, device = x.shape[0], weight.shape[1], weight.shape[0], x.device
    num_row_blocks = triton.cdiv(n, config.block_n)
    split_k = config.split_k
    if split_k > 1:
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=device)
        counters = split_k_counters(device, num_row_blocks)
    elif argmax is not None:
        partial = out  # unused
        counters = split_k_counters(device, 1)  # one ticket: free, as split-K launches are ordered
    else:
        partial = counters = out  # unused when SPLIT_K is 1
    has_argmax = argmax is not None
    if has_argmax:
        best_value = torch.empty(m, num_row_blocks, dtype=torch.float32, device=device)
        best_index = torch.empty(m, num_row_blocks, dtype=torch.int32, device=device)
    else:
        best_value = best_index = argmax = out  # unused
    block_m = _DOT_ROWS if config.use_dot else next_power_of_2(m)
    residual, norm_weight, residual_out, eps = norm if norm is not None else (None, out, out, 0.0)
    _gemv[(num_row_blocks, split_k)](
        x,
        weight,
        weight_scale if weight_scale is not None else out,
        bias if bias is not None else out,
        out,
        partial,
        counters,
        residual if residual is not None else out,
        norm_weight,
        residual_out,
        float(eps),
        best_value,
        best_index,
        argmax,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_M=block_m,
        SPLIT_K=split_k,
        NUM_STAGES=config.num_stages,
        USE_DOT=config.use_dot,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul_input,
        EVEN_K=k % config.block_k == 0,
        **dot_options(x.dtype),
        NORM_INPUT=norm is not None,
        HAS_RESIDUAL=residual is not None,
        ARGMAX=has_argmax,
        PREFETCH=_prefetch_tiles(config, m, k, silu_mul_input or norm is not None),
        HAS_W_SCALE=weight_scale is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_options(device),
    )


def gemv_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    argmax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv's output [M, N] and each row's argmax [M] int64, in one launch (greedy decoding's logits).

    The argmax is over the values as stored (rounded to x's dtype): the first index of the largest,
    NaN counting as the largest, as torch.argmax of the output. `config` as in gemv, without split-K;
    argmax_out: an [M] int64 tensor to write the argmax into.
    """
    m, n, config = _checked_argmax(x, weight, bias, config, argmax_out)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    argmax = torch.empty(m, dtype=torch.int64, device=x.device) if argmax_out is None else argmax_out
    if m:
        _launch(x, weight, bias, out, config, argmax=argmax)
    return out, argmax


def _checked_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
    argmax_out: torch.Tensor | None,
) -> tuple[int, int, GemvConfig]:
    """_checked, plus what the argmax needs: a row to take it over, no split-K, an [M] int64 argmax_out."""
    m, n, config = _checked(x, weight, bias, config, "gemv_argmax")
    if n == 0:
        raise ValueError("weight has no rows: there is no argmax of an empty row")
    if config.split_k != 1:
        raise ValueError(f"config {config.name} splits K; gemv_argmax needs split_k 1")
    if argmax_out is not None:
        check_operand("argmax_out", argmax_out, (m,), torch.int64, x.device)
    return m, n, config


def _prefetch_tiles(config: GemvConfig, m: int, k: int, fused_input: bool) -> int:
    """config.prefetch where the kernel can take it (one row, FMA, no split, plain input, enough K),
    else 0. A prefetch changes when weights are read and the order of the float32 sums, nothing else."""
    usable = (
        m == 1
        and not config.use_dot
        and config.split_k == 1
        and not fused_input
        and k >= config.prefetch * config.block_k
    )
    return config.prefetch if usable else 0


def fuses_rms_norm(config: GemvConfig) -> bool:
    """Whether gemv_rms_norm can run with `config`: the one-row FMA kernel without split-K."""
    return not config.use_dot and config.split_k == 1


def gemv_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm then a linear layer for one row, in one launch: (norm(s) @ weight^T (+ bias), s).

    s = x + residual (rounded to x's dtype), or x without a residual, x and residual [1, K]. The
    norm follows rms_norm (float32 statistics, times norm_weight) except that the normalised row is
    not rounded to the activation dtype before the product, so bfloat16 results differ from the
    unfused pair by rounding. `config` must satisfy fuses_rms_norm (default: pick_config's if it
    does, else the one-row default).
    """
    n, config = _checked_rms_norm(x, residual, norm_weight, weight, bias, config)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    if n:
        _launch(x, weight, bias, out, config, norm=(residual, norm_weight, residual_out, eps))
    return out, residual_out


def _checked_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
) -> tuple[int, GemvConfig]:
    """Check gemv_rms_norm's operands (one row; norm_weight [K] and residual like x) and config; return
    N and the config (pick_config's if it fuses the norm, else the one-row default)."""
    _check_operands(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if m != 1:
        raise ValueError(f"gemv_rms_norm takes one row, got {m}")
    check_operand("norm_weight", norm_weight, (k,), x.dtype, x.device)
    if residual is not None:
        check_operand("residual", residual, tuple(x.shape), x.dtype, x.device)
    if config is None:
        config = pick_config(1, n, k, device=x.device)
        if not fuses_rms_norm(config):
            config = _DEFAULT_SINGLE_ROW
    _check_config(config)
    if not fuses_rms_norm(config):
        raise ValueError(f"config {config.name} cannot fuse RMSNorm (needs the FMA kernel without split-K)")
    return n, config


def gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul_input: bool = False,
) -> torch.Tensor:
    """Pure torch: the (rounded) silu_and_mul input if asked, a float32 product, rounded to x's dtype."""
    if silu_mul_input:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def gemv_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch, gemv_rms_norm's numerics: s rounded to x's dtype, everything after in float32."""
    s = x if residual is None else x + residual
    s32 = s.float()
    rstd = torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    out = (s32 * norm_weight.float()) @ weight.float().t() * rstd
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype), s
