"""Block-scaled FP8 GEMM, DeepSeek's layout: out [M, N] = dequant(x_q) @ dequant(weight)^T (+ bias).

The weight [N, K] is float8_e4m3fn with one float32 scale (the checkpoint's weight_scale_inv, the
value that multiplies) per block of group_n rows and group_k columns; the activations are quantized
at run time to e4m3 per token and per group of group_k columns (quantize_fp8_groups), with one
float32 scale each. One K step of the kernel is one column group: its FP8 x FP8 product, summed on the
tensor cores, is scaled by a_scale * b_scale and added to a float32 accumulator, as DeepSeek's and
vLLM's kernels do. Weight scales are looked up per output column (`n // group_n`), so fused
projections whose shards do not end on a block boundary keep one scale row per output row (group_n 1).

Decode batches have few row tiles: a projection with few column tiles (DeepSeek-V3's q_a_proj, 1,536
outputs, is 24 tiles of 64) would leave most multiprocessors idle, so a launch may split K over
split_k programs per tile, each writing its float32 partial sum, added up after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpuworker.kernels import configs
from gpuworker.kernels.device import fp8_codec, matmul_tile
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_operand,
    check_tensor,
    interpreting,
    lazy_jit,
    pdl_options,
)
from gpuworker.kernels.quant.fp8_matmul import quantize_fp8_rows_reference
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE, FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@dataclass(frozen=True)
class BlockFp8GemmConfig:
    """Tiles of _block_fp8_matmul_kernel (BLOCK_K is the weight's column group)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Programs sharing one output tile's K loop (their partial sums added after); 0: as many as fill
    # the device with programs, for the tile grid of the call (auto_split_k).
    split_k: int = 1

    @property
    def name(self) -> str:
        split = "" if self.split_k == 1 else f"-s{self.split_k or 'auto'}"
        return f"blockfp8-m{self.block_m}-n{self.block_n}-w{self.num_warps}-p{self.num_stages}{split}"


# The tiles measured on each device: configs/block_fp8_matmul/<device>.json, {(row bucket,): config
# fields} from bench/block_fp8_gemm.py; M takes the smallest bucket holding it (the largest beyond).
# Without a file: DEFAULT_CONFIGS, 16-row tiles for decode batches (the smallest tensor-core tile)
# and vLLM's generic 64 x 128 tile with a two-stage pipeline beyond, which fit any GPU's shared memory.
GEMM_TABLE_KEY = ("rows",)
DEFAULT_CONFIGS = {
    16: BlockFp8GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, split_k=0),
    64: BlockFp8GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=3),
    1 << 30: BlockFp8GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=2),
}
# Under the interpreter (CPU tests): small tiles.
INTERPRETER_CONFIG = BlockFp8GemmConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)


def pick_config(m: int, *, on_cuda: bool, device: torch.device | None = None) -> BlockFp8GemmConfig:
    if not on_cuda:
        return INTERPRETER_CONFIG
    """The tiles for m rows: the device's table's smallest row bucket holding m (the largest beyond),
    DEFAULT_CONFIGS without a table; INTERPRETER_CONFIG off a GPU."""
    table = configs.table("block_fp8_matmul", GEMM_TABLE_KEY, device, BlockFp8GemmConfig)
    if not table:
        return DEFAULT_CONFIGS[configs.bucket(m, DEFAULT_CONFIGS)]
    buckets = [rows for (rows,) in table]
    return table[(configs.bucket(m, buckets) or max(buckets),)]


def _block_fp8_matmul_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_om,
    stride_split,
    GROUP_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m, offs_n, offs_k, m_mask, n_mask = matmul_tile.offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    a_scales = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
    b_scales = b_scale_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # With SPLIT_K programs per tile, program k takes column groups k, k + SPLIT_K, ...
    for kb in range(tl.program_id(2), tl.cdiv(K, BLOCK_K), SPLIT_K):
        ks = kb * BLOCK_K + offs_k
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # The weight tile transposed: [BLOCK_K, BLOCK_N] of rows of the [N, K] weight.
        b = tl.load(b_rows + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a_scale = tl.load(a_scales + kb, mask=m_mask, other=0.0)
        b_scale = tl.load(b_scales + kb, mask=n_mask, other=0.0)
        if DOT_FP32:  # the interpreter: products in float32
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            # One column group's FP8 x FP8 sum leaves the MMA after BLOCK_K products, scaled into float32.
            part = tl.dot(a, b)
        acc += part * a_scale[:, None] * b_scale[None, :]
    acc = matmul_tile.add_bias(acc, bias_ptr, offs_n, n_mask, HAS_BIAS)
    # Split: out_ptr is the float32 partial sums [SPLIT_K, M, N] (bias added with them, after).
    out_ptr += tl.program_id(2).to(tl.int64) * stride_split
    matmul_tile.store(out_ptr, acc, stride_om, offs_m, offs_n, m_mask, n_mask)


# M and the partial sums' stride (M * N) change with every batch: not specialisation keys (launch.LazyJIT).
_block_fp8_matmul = lazy_jit(_block_fp8_matmul_kernel, do_not_specialize=("M", "stride_split"))


def block_fp8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_n: int,
    group_k: int,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: BlockFp8GemmConfig | None = None,
) -> torch.Tensor:
    """x_q [M, K] float8_e4m3fn with x_scale [M, ceil(K / group_k)] float32, @ (weight [N, K]
    float8_e4m3fn with weight_scale [ceil(N / group_n), ceil(K / group_k)] float32)^T (+ bias [N] in
    out_dtype) -> [M, N] in out_dtype, accumulated in float32."""
    check_tensor("x_q", x_q, ndim=2, dtypes=(FP8_DTYPE,))
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=x_q.device)
    m, k = x_q.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns but x_q has {k}")
    if group_k < 16 or group_k & (group_k - 1):
        raise ValueError(f"group_k must be a power of two of at least 16, got {group_k}")
    if group_n < 1:
        raise ValueError(f"group_n must be positive, got {group_n}")
    k_groups = -(-k // group_k)
    check_operand("x_scale", x_scale, (m, k_groups), torch.float32, x_q.device)
    check_operand("weight_scale", weight_scale, (-(-n // group_n), k_groups), torch.float32, x_q.device)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be a float dtype, got {out_dtype}")
    if bias is not None:
        check_operand("bias", bias, (n,), out_dtype, x_q.device)
    for name, tensor in (("x_q", x_q), ("weight", weight), ("x_scale", x_scale), ("weight_scale", weight_scale)):
        check_last_dim_contiguous(name, tensor)
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    config = config or pick_config(m, on_cuda=x_q.is_cuda, device=x_q.device)
    tiles = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    k_groups = triton.cdiv(k, group_k)
    split_k = auto_split_k(tiles[0] * tiles[1], k_groups, x_q.device) if config.split_k == 0 else config.split_k
    split_k = max(1, min(split_k, k_groups))
    # Split: each program's float32 partial sum in its own slice, added up (with the bias) below.
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x_q.device)
    _block_fp8_matmul[(*tiles, split_k)](
        x_q,
        x_scale,
        weight,
        weight_scale,
        bias if bias is not None else weight_scale,
        target,
        m,
        n,
        k,
        x_q.stride(0),
        x_scale.stride(0),
        weight.stride(0),
        weight_scale.stride(0),
        target.stride(-2),
        target.stride(0) if split_k > 1 else 0,
        GROUP_N=group_n,
        HAS_BIAS=bias is not None and split_k == 1,
        DOT_FP32=interpreting(),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=group_k,
        SPLIT_K=split_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_options(x_q.device),
    )
    if split_k == 1:
        return out
    total = target.sum(dim=0)
    if bias is not None:
        total += bias.float()
    return out.copy_(total)


# Programs per multiprocessor an automatic split aims at, and the most K splits it takes.
SPLIT_PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 16


def auto_split_k(tiles: int, k_groups: int, device: torch.device) -> int:
    """K splits that give `tiles` output tiles SPLIT_PROGRAMS_PER_SM programs per multiprocessor, each
    with at least two column groups to sum (1 where the tiles fill the device already)."""
    from gpuworker.kernels.attention.paged_decode import multiprocessor_count

    wanted = -(-SPLIT_PROGRAMS_PER_SM * multiprocessor_count(device) // tiles)
    return max(1, min(wanted, k_groups // 2, MAX_SPLIT_K))


# FP8 e4m3 tensor-core products (and Triton's float8e4nv type) start with Ada and Hopper.
MIN_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """A ValueError naming the GPU where it cannot run these kernels (compute capability below 8.9)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise ValueError(
            f"block-wise FP8 needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
            f"later (Ada, Hopper); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
        )


def dequantize_block_fp8(values: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int) -> torch.Tensor:
    """float32 values [R, C] (FP8 or already float) times the scale of their block: scale [ceil(R /
    group_n), ceil(C / group_k)]; the last row and column blocks may be partial."""
    rows, cols = values.shape
    per_element = scale.float().repeat_interleave(group_n, dim=0)[:rows].repeat_interleave(group_k, dim=1)[:, :cols]
    return values.float() * per_element


def block_fp8_matmul_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_n: int,
    group_k: int,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Pure torch: both operands dequantised to float32 (per call: the CPU path keeps FP8 in memory),
    then one float32 matmul."""
    x = dequantize_block_fp8(x_q, x_scale, 1, group_k)
    w = dequantize_block_fp8(weight, weight_scale, group_n, group_k)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.float()).to(out_dtype)


def _quantize_groups_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_q,
    stride_s,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # GROUPS_PER_PROGRAM column groups of one row per program, held as a [groups, GROUP] tile: each
    # group's largest magnitude maps to FP8_MAX, as quantize_fp8_rows does for a whole row (same
    # rounding: a correctly rounded scale and reciprocal, one float32 product a value).
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), _FP8_MAX)
    q = fp8_codec.quantize_by_reciprocal(x, scale[:, None])  # on the e4m3 grid already: the cast is exact
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_s + groups, scale, mask=groups * GROUP < K)


_quantize_groups = lazy_jit(_quantize_groups_kernel)

# Values a program quantizes: 1,024 (8 groups of 128) a launch step.
VALUES_PER_PROGRAM = 1024


def quantize_fp8_groups(
    x: torch.Tensor, group_size: int, *, use_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (float8_e4m3fn [M, K], float32 scale [M, ceil(K / group_size)]) with x ~= q *
    scale per token and group of group_size columns (the last group may be partial), each group's
    largest magnitude mapped to FP8_MAX. On a GPU one Triton launch; elsewhere the torch reference,
    which gives the same values. use_kernel: the Triton launch (True; under the interpreter on a CPU,
    for its tests) or the reference (False) whatever the device."""
    kernel = x.is_cuda if use_kernel is None else use_kernel
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, for_kernel=kernel)
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two of at least 16, got {group_size}")
    if not kernel or x.shape[0] == 0:
        return quantize_fp8_groups_reference(x, group_size)
    check_last_dim_contiguous("x", x)
    m, k = x.shape
    num_groups = -(-k // group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    per_program = max(1, min(VALUES_PER_PROGRAM // group_size, triton.next_power_of_2(num_groups)))
    _quantize_groups[(m, triton.cdiv(num_groups, per_program))](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        GROUP=group_size,
        GROUPS_PER_PROGRAM=per_program,
        num_warps=4,
        **pdl_options(x.device),
    )
    return q, scale


def quantize_fp8_groups_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_groups in torch ops: each group a row of quantize_fp8_rows_reference (the columns
    past K zero, which leave every group's largest magnitude as it is)."""
    m, k = x.shape
    num_groups = -(-k // group_size)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * group_size - k))
    q, scale = quantize_fp8_rows_reference(padded.reshape(m * num_groups, group_size))
    return q.reshape(m, num_groups * group_size)[:, :k].contiguous(), scale.reshape(m, num_groups)
