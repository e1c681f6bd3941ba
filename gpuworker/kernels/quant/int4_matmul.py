"""INT4 weight-only GEMM: out [M, N] = x [M, K] @ dequant(W)^T (+ bias), W [K, N] 4-bit with a
scale and a zero point per group of GROUP_SIZE input rows, dequantised in the kernel.

One layout for AWQ and GPTQ checkpoints (models.quantization converts both at load):
- qweight int32 [K / 8, N]: nibble j (bits 4j..4j+3) of qweight[i, n] is q[8i + j, n];
- zeros uint8 [K / G, N]: the zero point of each group and column (0..16: old GPTQ checkpoints
  can mean 16);
- scales float16 [K / G, N].
W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n], computed in float32 and rounded to x's
dtype before the product, as the reference does. A weight is a quarter of bf16's bytes; each program
owns a BLOCK_M x BLOCK_N tile of the output and walks K with tl.dot. A single row (batch-1 decode)
takes a GEMV of its own (a weight stream): each program owns BLOCK_N adjacent columns (one
contiguous run of each packed row) and, with split-K, a share of K; it walks whole groups, several per
step, unpacking the eight nibbles of each int32 in registers without integer-to-float conversions
(every weight byte read once) and applying a group's zero point and scale once per packed row and
column. Its tiles come from the device's table (configs/int4_gemv/, bench/quant_gemv.py), else
default_gemv_config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from gpuworker.checkpoint_quantization import int4_group_size_supported
from gpuworker.kernels import configs
from gpuworker.kernels.device import matmul_tile
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_operand,
    check_tensor,
    dot_options,
    lazy_jit,
    pdl_options,
    split_k_counters,
)

PACK = 8  # 4-bit values per int32


def _int4_matmul_kernel(
    x_ptr,
    qweight_ptr,
    zeros_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # A step reads BLOCK_K / 8 packed rows once ([BLOCK_K / 8, BLOCK_N] int32, each word once) and
    # spreads their nibbles to [BLOCK_K, BLOCK_N]; BLOCK_K divides GROUP_SIZE (the launcher's rule),
    # so a step lies in one group and takes one zero point and one scale per column. K is a multiple
    # of GROUP_SIZE, so no step needs a K mask.
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m, offs_n, offs_k, m_mask, n_mask = matmul_tile.offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = qweight_ptr + offs_p[:, None].to(tl.int64) * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group = k0 // GROUP_SIZE
        zeros = tl.load(zeros_ptr + group * N + offs_n, mask=n_mask, other=0).to(tl.float32)
        scales = tl.load(scales_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        packed = tl.load(w_ptrs, mask=n_mask[None, :], other=0)
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        w = ((q.to(tl.float32) - zeros[None, :]) * scales[None, :]).to(x.dtype)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += (BLOCK_K // 8) * N
    acc = matmul_tile.add_bias(acc, bias_ptr, offs_n, n_mask, HAS_BIAS)
    matmul_tile.store(out_ptr, acc, stride_om, offs_m, offs_n, m_mask, n_mask)


def _dequantize_kernel(
    qweight_ptr,
    zeros_ptr,
    scales_ptr,
    out_ptr,
    N,
    GROUP_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # out [K, N] (W transposed, x's dtype) from BLOCK_P packed rows x BLOCK_N columns a program: each
    # word read once, each weight written once, rows of out stored whole (coalesced along N).
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n[None, :] < N
    packed = tl.load(qweight_ptr + offs_p[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_mask, other=0)
    group_offsets = (offs_p * 8 // GROUP_SIZE)[:, None].to(tl.int64) * N + offs_n[None, :]
    zeros = tl.load(zeros_ptr + group_offsets, mask=n_mask, other=0).to(tl.float32)
    scales = tl.load(scales_ptr + group_offsets, mask=n_mask, other=0.0).to(tl.float32)
    rows = out_ptr + (offs_p * 8)[:, None].to(tl.int64) * N + offs_n[None, :]
    for j in tl.static_range(8):
        q = ((packed >> (4 * j)) & 0xF).to(tl.float32)
        tl.store(rows + j * N, ((q - zeros) * scales).to(out_ptr.dtype.element_ty), mask=n_mask)


# N stays specialised: known to be a multiple of 16, the masked loads and stores are vectorised (with
# N a plain value they were not, and the kernel took 4x as long on the H200).
_dequantize = lazy_jit(_dequantize_kernel)
_int4_matmul = lazy_jit(_int4_matmul_kernel, do_not_specialize=("M",))


@dataclass(frozen=True)
class Int4GemvConfig:
    """How the one-row GEMV tiles [K / 8, N]: BLOCK_N columns per program, BLOCK_K input rows (whole
    groups, at least one) per loop step, SPLIT_K programs sharing each column block's K."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    # bfloat16 x read as 32-bit words, two values each (half the loads, no conversions).
    x_words: bool = False

    @property
    def name(self) -> str:
        return f"int4-n{self.block_n}-k{self.block_k}-w{self.num_warps}-p{self.num_stages}-s{self.split_k}" + (
            "-xw" if self.x_words else ""
        )


@dataclass(frozen=True)
class Int4GemmConfig:
    """Tensor-core tiles of the batched kernel: BLOCK_M rows x BLOCK_N columns a program, BLOCK_K
    input rows a step (at most a group: the launcher clamps it)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"int4mm-m{self.block_m}-n{self.block_n}-k{self.block_k}-w{self.num_warps}-p{self.num_stages}"


# From this many rows the batched path dequantises the weight and calls cuBLAS (int4_matmul): once the
# product is compute-bound, a dequantised copy at cuBLAS's tensor-core speed beats dequantising in the
# fused kernel's inner loop (bench/quant_gemm.py on the H200: at every row count from 16 to 8,192;
# BENCHMARKS.md).
DEQUANT_MIN_ROWS = 16
DEQUANT_BLOCK_P, DEQUANT_BLOCK_N = 16, 128

# The batched kernel's tiles measured on each device: configs/int4_matmul/<device>.json, {(row bucket,):
# Int4GemmConfig fields} from bench/quant_gemm.py; M takes the smallest bucket holding it (the largest
# beyond). Below DEQUANT_MIN_ROWS the fastest tile at 16 rows is all a device needs. Without a file:
# DEFAULT_GEMM, a 16-row tensor-core tile whose pipeline fits any GPU's shared memory.
GEMM_TABLE_KEY = ("rows",)
DEFAULT_GEMM = Int4GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2)
# Under the interpreter (CPU tests): small tiles.
INTERPRETER_GEMM = Int4GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def pick_gemm_config(m: int, group_size: int, *, on_cuda: bool, device: torch.device | None = None) -> Int4GemmConfig:
    """The device's tiles for the smallest row bucket holding m (the largest beyond; DEFAULT_GEMM
    without a table), block_k clamped to the group size (a step within one group)."""
    if not on_cuda:
        config = INTERPRETER_GEMM
    else:
        table = configs.table("int4_matmul", GEMM_TABLE_KEY, device, Int4GemmConfig)
        buckets = [rows for (rows,) in table]
        row_bucket = configs.bucket(m, buckets) or max(buckets, default=None)
        config = DEFAULT_GEMM if row_bucket is None else table[(row_bucket,)]
    return replace(config, block_k=min(config.block_k, group_size))


# The one-row GEMV's configs measured on each device: configs/int4_gemv/<device>.json, {(N, K,
# group_size): Int4GemvConfig fields} from bench/quant_gemv.py. Shapes not listed take
# default_gemv_config.
GEMV_TABLE_KEY = ("n", "k", "group_size")

# The default aims at about four programs per SM of an H200 (132 SMs): a batch-1 GEMV is a weight
# stream, and a program streaming one column block's whole K is latency-bound at N = 4096.
TARGET_PROGRAMS = 512


def default_gemv_config(n: int, k: int, group_size: int) -> Int4GemvConfig:
    """64 columns (256 contiguous bytes of each packed row), 256 input rows a step (8 KB of weights),
    and split-K doubled until about TARGET_PROGRAMS programs or one step per split."""
    config = Int4GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=3)
    column_blocks = -(-n // config.block_n)
    steps = -(-k // max(config.block_k, group_size))
    split_k = 1
    while column_blocks * split_k < TARGET_PROGRAMS and split_k * 2 <= steps:
        split_k *= 2
    return replace(config, split_k=split_k)


def pick_gemv_config(n: int, k: int, group_size: int, device: torch.device | None = None) -> Int4GemvConfig:
    """The config measured on `device` (None: the current one) for (N, K, group_size), else
    default_gemv_config's."""
    config = configs.table("int4_gemv", GEMV_TABLE_KEY, device, Int4GemvConfig).get((n, k, group_size))
    return config or default_gemv_config(n, k, group_size)


def _int4_gemv_kernel(
    x_ptr,
    qweight_ptr,
    zeros_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    N,
    NUM_GROUPS,
    SPLIT_K,
    NIBBLE_MASK,
    GROUP_SIZE: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_WORDS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Each step loads GROUPS_PER_STEP whole groups, a [GROUPS_PER_STEP, ROWS, BLOCK_N] tile of packed
    # rows: a group's ROWS packed rows share one zero point and one scale per column, so
    # sum_k (q_k - z) * s * x_k = s * (sum_k q_k x_k - z * sum_k x_k), applied per packed row and
    # column (two FMAs per eight weights). The accumulator keeps the tile's shape, so the only
    # cross-thread reduction is the one after the loop.
    ROWS: tl.constexpr = GROUP_SIZE // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_g = tl.arange(0, GROUPS_PER_STEP)
    offs_r = tl.arange(0, ROWS)
    # Each split owns a contiguous run of whole steps; a split past the last step stores zeros.
    num_steps = tl.cdiv(NUM_GROUPS, GROUPS_PER_STEP)
    steps_per_split = tl.cdiv(num_steps, SPLIT_K)
    step_start = pid_k * steps_per_split
    step_end = tl.minimum(step_start + steps_per_split, num_steps)
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Pointers for the split's first step, advanced by a step each iteration (cheaper than
    # recomputing 64-bit addresses from the step index).
    groups = step_start * GROUPS_PER_STEP + offs_g
    ps = groups[:, None] * ROWS + offs_r[None, :]  # packed rows: input rows 8p .. 8p+7
    w_ptrs = qweight_ptr + ps[:, :, None].to(tl.int64) * N + offs_n[None, None, :]
    group_offsets = groups[:, None].to(tl.int64) * N + offs_n[None, :]
    z_ptrs = zeros_ptr + group_offsets
    s_ptrs = scales_ptr + group_offsets
    x_ptrs = x_ptr + ps * 8
    if X_WORDS:  # bfloat16 x read as uint32 words, two values each (4-byte aligned: the launcher checks)
        xw_ptrs = x_ptr.to(tl.pointer_type(tl.uint32)) + ps * 4
    else:
        xw_ptrs = None  # x read as values (x_ptrs)
    acc = tl.zeros((GROUPS_PER_STEP, ROWS, BLOCK_N), dtype=tl.float32)
    for step in tl.range(step_start, step_end, num_stages=NUM_STAGES):
        if MASKED:  # a column tail or a last step past the last group
            g_mask = step * GROUPS_PER_STEP + offs_g < NUM_GROUPS
            gn_mask = g_mask[:, None] & n_mask[None, :]
            packed = tl.load(w_ptrs, mask=gn_mask[:, None, :], other=0, eviction_policy="evict_first")
            zeros = tl.load(z_ptrs, mask=gn_mask, other=0).to(tl.float32)
            scales = tl.load(s_ptrs, mask=gn_mask, other=0.0).to(tl.float32)
            x_mask = g_mask[:, None] & (offs_r[None, :] < ROWS)
        else:
            packed = tl.load(w_ptrs, eviction_policy="evict_first")
            zeros = tl.load(z_ptrs).to(tl.float32)
            scales = tl.load(s_ptrs).to(tl.float32)
            x_mask = None  # whole groups and columns
        qx, xs = _nibble_products(
            packed, x_ptrs, xw_ptrs, x_mask, NIBBLE_MASK, GROUPS_PER_STEP, ROWS, BLOCK_N, MASKED, X_WORDS
        )
        acc += scales[:, None, :] * (qx - zeros[:, None, :] * xs[:, :, None])
        w_ptrs += GROUPS_PER_STEP * ROWS * N
        z_ptrs += GROUPS_PER_STEP * N
        s_ptrs += GROUPS_PER_STEP * N
        x_ptrs += GROUPS_PER_STEP * GROUP_SIZE
        if X_WORDS:
            xw_ptrs += GROUPS_PER_STEP * GROUP_SIZE // 2
    out = tl.sum(tl.sum(acc, axis=1), axis=0)
    _store_columns(
        out, offs_n, n_mask, pid_n, pid_k, N, SPLIT_K, bias_ptr, out_ptr, partial_ptr, counter_ptr, BLOCK_N, HAS_BIAS
    )


@triton.jit
def _nibble_products(
    packed,
    x_ptrs,
    xw_ptrs,
    x_mask,
    NIBBLE_MASK,
    GROUPS_PER_STEP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    X_WORDS: tl.constexpr,
):
    """(qx, xs) of one step's packed rows [GROUPS_PER_STEP, ROWS, BLOCK_N] and their inputs (x_ptrs:
    input row 8p of packed row p; xw_ptrs: the same as uint32 words with X_WORDS): qx the sum of each
    word's eight q * x, xs [GROUPS_PER_STEP, ROWS] the sum of its eight x, in float32."""
    # Nibbles without integer-to-float conversions (a quarter-rate instruction that capped the
    # kernel below copy bandwidth): nibble i of a word, left in place at bits 4i..4i+3 and OR-ed
    # with the exponent of 2**(23 - 4i), is the float 2**(23 - 4i) + q exactly; one subtraction
    # leaves q. Nibbles 0-3 are read in place, 4-7 after one logical shift by 16 (bits past 22
    # would reach the exponent). The masks derive from NIBBLE_MASK (0xF), a plain argument: as
    # literals, ptxas re-materialised each one with a MOV before every AND-OR (a sixth of the loop).
    low = packed.to(tl.uint32, bitcast=True)
    high = low >> 16
    qx = tl.zeros((GROUPS_PER_STEP, ROWS, BLOCK_N), dtype=tl.float32)
    xs = tl.zeros((GROUPS_PER_STEP, ROWS), dtype=tl.float32)
    for j in tl.static_range(8):
        if X_WORDS:
            # Half the loads of x and no conversion: bfloat16 is float32's top half, so the
            # even value is the word shifted up and the odd one the word's top half in place.
            if j % 2 == 0:
                if MASKED:
                    x_word = tl.load(xw_ptrs + j // 2, mask=x_mask, other=0, eviction_policy="evict_last")
                else:
                    x_word = tl.load(xw_ptrs + j // 2, eviction_policy="evict_last")
                x = (x_word << 16).to(tl.float32, bitcast=True)
            else:
                x = (x_word & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            if MASKED:
                x = tl.load(x_ptrs + j, mask=x_mask, other=0.0, eviction_policy="evict_last")
            else:
                x = tl.load(x_ptrs + j, eviction_policy="evict_last")
            if x_ptrs.dtype.element_ty == tl.bfloat16:
                # bfloat16 is float32's top half. Triton's own conversion converted each x twice
                # (its pairwise conversion of a layout that holds every x twice per thread).
                x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                x = x.to(tl.float32)
        word = low if j < 4 else high
        bits = (word & (NIBBLE_MASK << (4 * (j % 4))).to(tl.uint32)) | ((150 - 4 * (j % 4)) << 23)
        q = bits.to(tl.float32, bitcast=True) - float(2 ** (23 - 4 * (j % 4)))
        qx += q * x[:, :, None]
        xs += x
    return qx, xs


@triton.jit
def _store_columns(
    out,
    offs_n,
    n_mask,
    pid_n,
    pid_k,
    N,
    SPLIT_K,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The columns offs_n of the output row: out (float32 sums) plus the bias; with split-K (SPLIT_K
    > 1) this split's partial, and the last split to draw its ticket sums them in split order
    (deterministic), as gemv's split-K: the barrier orders every thread's partial stores before the
    (one-thread, acq_rel, gpu-scope) ticket."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(partial_ptr + pid_k * N + offs_n, out, mask=n_mask)  # partial [SPLIT_K, N] float32
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + pid_n, 1)
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for split in range(0, SPLIT_K):
                # .cg: from L2, never a line this SM cached before the other splits wrote it.
                total += tl.load(partial_ptr + split * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch


# SPLIT_K is a plain argument so that one compile serves every split count of a tile shape;
# NIBBLE_MASK must stay a run-time value (see the kernel).
_int4_gemv = lazy_jit(_int4_gemv_kernel, do_not_specialize=("SPLIT_K", "NIBBLE_MASK"))


def _launch_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: Int4GemvConfig,
) -> None:
    k, n = x.shape[1], qweight.shape[1]
    num_groups = k // group_size
    groups_per_step = max(1, config.block_k // group_size)
    column_blocks = -(-n // config.block_n)
    if config.split_k > 1:
        partial = torch.empty(config.split_k, n, dtype=torch.float32, device=x.device)
        counters = split_k_counters(x.device, column_blocks)
    else:
        # Unused, but both branches compile (SPLIT_K is a run-time value): the ticket's atomic needs
        # an int32 pointer (an atomic add on a bfloat16 pointer fails to compile on Triton 3.6).
        partial, counters = out, qweight
    _int4_gemv[(column_blocks, config.split_k)](
        x,
        qweight,
        zeros,
        scales,
        bias if bias is not None else scales,
        out,
        partial,
        counters,
        n,
        num_groups,
        config.split_k,
        0xF,
        GROUP_SIZE=group_size,
        GROUPS_PER_STEP=groups_per_step,
        BLOCK_N=config.block_n,
        NUM_STAGES=config.num_stages,
        MASKED=bool(n % config.block_n or num_groups % groups_per_step),
        HAS_BIAS=bias is not None,
        X_WORDS=config.x_words and x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0,
        num_warps=config.num_warps,
        **pdl_options(x.device),
    )


def check_gemv_config(config: Int4GemvConfig) -> None:
    """Tile sizes are powers of 2 (Triton's aranges); split_k and num_stages any positive int."""
    for field in ("block_n", "block_k", "num_warps", "split_k", "num_stages"):
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"gemv_config.{field} must be a positive int, got {value!r}")
    for field in ("block_n", "block_k", "num_warps"):
        value = getattr(config, field)
        if value & (value - 1):
            raise ValueError(f"gemv_config.{field} must be a power of 2, got {value}")
    if config.block_k < PACK:
        raise ValueError(f"gemv_config.block_k must be at least {PACK} (one packed row), got {config.block_k}")


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    gemv_config: Int4GemvConfig | None = None,
    gemm_config: Int4GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] float @ dequant(qweight, zeros, scales)^T (+ bias [N]) -> [M, N] in x's dtype
    (the layout in the module docstring), accumulated in float32. One row takes the GEMV with
    gemv_config (default: pick_gemv_config's); a split-K config must run once outside CUDA graph
    capture before it is captured (launch.split_k_counters). More rows take the batched kernel
    with gemm_config (default: pick_gemm_config's), or from DEQUANT_MIN_ROWS rows, unless a
    gemm_config is given, a dequantised copy of the weight and torch.mm."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k, n = _check_layout(x, qweight, zeros, scales, group_size)
    if bias is not None:
        check_operand("bias", bias, (n,), x.dtype, x.device)
    check_last_dim_contiguous("x", x)
    if gemv_config is not None:
        check_gemv_config(gemv_config)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if m == 1:
        _launch_gemv(
            x,
            qweight,
            zeros,
            scales,
            group_size,
            bias,
            out,
            gemv_config or pick_gemv_config(n, k, group_size, x.device),
        )
        return out
    if m >= DEQUANT_MIN_ROWS and gemm_config is None:
        # Dequantise the weight into a scratch copy (a quarter of its bf16 bytes read, the bf16
        # bytes written) and let cuBLAS multiply: faster than our fused kernel from 16 rows.
        weight_t = dequantize_int4_to(qweight, zeros, scales, group_size, x.dtype)
        return torch.mm(x, weight_t, out=out) if bias is None else torch.addmm(bias, x, weight_t, out=out)
    config = gemm_config or pick_gemm_config(m, group_size, on_cuda=x.is_cuda, device=x.device)
    if config.block_k > group_size or group_size % config.block_k:
        raise ValueError(f"gemm_config.block_k must divide group_size ({group_size}), got {config.block_k}")
    _int4_matmul[(-(-m // config.block_m), -(-n // config.block_n))](
        x,
        qweight,
        zeros,
        scales,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **dot_options(x.dtype),
        **pdl_options(x.device),
    )
    return out


def _check_layout(
    x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[int, int, int]:
    m, k = x.shape
    if not int4_group_size_supported(group_size) or k % group_size:
        raise ValueError(f"group_size must be a power of two of at least {PACK} dividing K ({k}), got {group_size!r}")
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=x.device)
    if qweight.shape[0] * PACK != k:
        raise ValueError(f"qweight must have K / {PACK} = {k // PACK} rows, got shape {tuple(qweight.shape)}")
    n = qweight.shape[1]
    check_operand("zeros", zeros, (k // group_size, n), torch.uint8, x.device)
    check_operand("scales", scales, (k // group_size, n), torch.float16, x.device)
    for name, tensor in (("qweight", qweight), ("zeros", zeros), ("scales", scales)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return m, k, n


def dequantize_int4(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight [N, K] (the layout Linear holds) that the packed weight stands for."""
    q = unpack_rows(qweight)
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    w = (q - zeros.to(torch.int32)[groups]).float() * scales.float()[groups]
    return w.t()


def dequantize_int4_to(
    qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight transposed, [K, N] in dtype, as dequantize_int4(...).t().to(dtype) gives it (each
    value computed in float32, then rounded), in one Triton launch."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_p = min(DEQUANT_BLOCK_P, group_size // PACK, k // PACK)
    _dequantize[(k // PACK // block_p, -(-n // DEQUANT_BLOCK_N))](
        qweight,
        zeros,
        scales,
        out,
        n,
        GROUP_SIZE=group_size,
        BLOCK_P=block_p,
        BLOCK_N=DEQUANT_BLOCK_N,
        num_warps=4,
        **pdl_options(qweight.device),
    )
    return out


def int4_matmul_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure torch: the weight dequantised in float32 and rounded to x's dtype, then F.linear."""
    weight = dequantize_int4(qweight, zeros, scales, group_size).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int values 0..15 [K, N] -> int32 [K / 8, N], row 8i + j in nibble j of row i."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"the packed dimension must be a multiple of {PACK}, got {k}")
    nibbles = q.to(torch.int64).reshape(k // PACK, PACK, n) & 0xF
    shifts = (4 * torch.arange(PACK, device=q.device, dtype=torch.int64)).reshape(1, PACK, 1)
    words = (nibbles << shifts).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """pack_rows' inverse: int32 [K / 8, N] -> int32 values 0..15 [K, N]."""
    shifts = (4 * torch.arange(PACK, device=qweight.device, dtype=torch.int32)).reshape(1, PACK, 1)
    q = (qweight.unsqueeze(1) >> shifts) & 0xF
    return q.reshape(-1, qweight.shape[1])
