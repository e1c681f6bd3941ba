"""FP8 weight GEMM: out [M, N] = (x * x_scale) @ (weight * weight_scale)^T (+ bias), for FP8 e4m3
checkpoints, with the weight dequantised in the kernel.

The weight [N, K] is read as float8_e4m3fn (half the bytes of bf16, which is the point at decode);
its float32 scale per output channel (a per-tensor scale is repeated per channel at load) and the
activations' scale per row (x quantized to FP8 per token or with a static scale; x_scale None: x
left in the model dtype) are applied to the float32 accumulator once per tile. FP8 x takes FP8
tensor-core products; a float x multiplies the weight converted to its dtype; a single row (batch-1
decode) is a GEMV of CUDA-core FMAs over narrow weight tiles instead. Decode batches and the
shapes torch._scaled_mm does not take run here; models.quantization.fp8 picks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The e4m3 format (dtype, largest finite value), shared with the FP8 KV cache.
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
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE, FP8_MAX


def _fp8_matmul_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_X_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m, offs_n, offs_k, m_mask, n_mask = matmul_tile.offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        # The weight tile transposed: [BLOCK_K, BLOCK_N] of rows of the [N, K] weight.
        w = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if BLOCK_M == 1:  # one decode row: a weight stream through CUDA-core FMAs, no tile padded to 16 rows
            acc += tl.sum(tl.trans(x).to(tl.float32) * w.to(tl.float32), axis=0)[None, :]
        elif UPCAST:  # float32 x, or the interpreter: products in float32
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
        elif HAS_X_SCALE:
            # FP8 x FP8 on the tensor cores, each K tile's sum added in float32 here: Hopper's FP8 MMAs
            # accumulate with fewer bits than float32 (left in the MMA over K = 4096, outputs were off
            # by ~1e-3 relative on the H200), so a tile's sum leaves them after BLOCK_K (128) products.
            acc += tl.dot(x, w)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * w_scale[None, :]
    if HAS_X_SCALE:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
        acc = acc * x_scale[:, None]
    acc = matmul_tile.add_bias(acc, bias_ptr, offs_n, n_mask, HAS_BIAS)
    matmul_tile.store(out_ptr, acc, stride_om, offs_m, offs_n, m_mask, n_mask)


_fp8_matmul = lazy_jit(_fp8_matmul_kernel, do_not_specialize=("M",))


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] (FP8 with x_scale [M] float32, or a float dtype without) @ (weight [N, K] float8_e4m3fn
    * weight_scale [N] float32)^T (+ bias [N] in out_dtype) -> [M, N] in out_dtype (default: x's
    dtype; required for FP8 x), accumulated in float32."""
    check_tensor("x", x, ndim=2, dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=x.device)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns but x has {k}")
    check_operand("weight_scale", weight_scale, (n,), torch.float32, x.device)
    if (x.dtype == FP8_DTYPE) != (x_scale is not None):
        raise ValueError("x_scale is required for FP8 x and only for FP8 x")
    if x_scale is not None:
        check_operand("x_scale", x_scale, (m,), torch.float32, x.device)
    if out_dtype is None:
        if x.dtype == FP8_DTYPE:
            raise ValueError("out_dtype is required for FP8 x")
        out_dtype = x.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be a float dtype, got {out_dtype}")
    if bias is not None:
        check_operand("bias", bias, (n,), out_dtype, x.device)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = _tiles(m, x.is_cuda)
    upcast = x.dtype == torch.float32 or interpreting()
    _fp8_matmul[(-(-m // block_m), -(-n // block_n))](
        x,
        x_scale if x_scale is not None else weight_scale,
        weight,
        weight_scale,
        bias if bias is not None else weight_scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_X_SCALE=x_scale is not None,
        HAS_BIAS=bias is not None,
        UPCAST=upcast,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if upcast else "tf32",
        num_warps=4,
        **pdl_options(x.device),
    )
    return out


def _tiles(m: int, on_cuda: bool) -> tuple[int, int, int]:
    """BLOCK_M, BLOCK_N, BLOCK_K: one row streams narrow, deep weight tiles (many programs, long
    loads); batches take tensor-core tiles. Generic tiles for any GPU: no sweep measures them, so they
    have no per-device table (gpuworker/kernels/configs)."""
    if m == 1:
        return (1, 16, 256) if on_cuda else (1, 16, 32)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return (block_m, 64, 128) if on_cuda else (block_m, 32, 32)


def fp8_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure torch: dequantise both operands to float32, then one float32 matmul."""
    out_dtype = out_dtype or x.dtype
    xf = x.float() if x_scale is None else x.float() * x_scale[:, None]
    out = torch.nn.functional.linear(xf, weight.float() * weight_scale[:, None], None if bias is None else bias.float())
    return out.to(out_dtype)


def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_scale_ptr,
    K,
    stride_x,
    stride_q,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One row per program: its largest magnitude (dynamic), then x times the scale's reciprocal,
    # clamped and rounded to FP8, as quantize_fp8_rows_reference computes it: scale and reciprocal
    # correctly rounded divisions, once a row; a float32 product an element (a division an element
    # made the kernel compute-bound: 16 us a launch at 512 rows on the H200). The rounding is
    # kv_cache_fp8's, which the interpreter also gets right. ONE_PASS (BLOCK >= K): the row is held in
    # registers, so it is read from memory once; longer rows are read twice.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if ONE_PASS:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_scale_ptr).to(tl.float32)
        else:
            scale = fp8_codec.row_scale(x)
        tl.store(scale_ptr + row, scale)
        tl.store(q_row + offs, fp8_codec.quantize_by_reciprocal(x, scale).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        if STATIC:
            scale = tl.load(static_scale_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = fp8_codec.row_scale(amax)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            q = fp8_codec.quantize_by_reciprocal(x, scale)  # on the e4m3 grid already: the cast is exact
            tl.store(q_row + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


# K stays specialised: known to be a multiple of 16, the masked loads and stores are vectorised (as a
# plain value, they were one element at a time: 16-bit loads and byte stores, sm_90 PTX).
_quantize_rows = lazy_jit(_quantize_rows_kernel)

# Rows up to this long are quantized in one pass (held in registers: 32 float32 values a thread at 16
# warps); longer ones in 2,048-value blocks, read twice. Two passes over Llama-3-8B's 4,096- and
# 14,336-wide activations ran at ~46% of the H200's copy bandwidth (10.9 of a 131 ms FP8 prefill step).
ONE_PASS_MAX = 16384


def quantize_fp8_rows(
    x: torch.Tensor, static_scale: torch.Tensor | None = None, *, use_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (float8_e4m3fn [M, K], float32 scale [M]) with x ~= q * scale per row.

    static_scale (a float32 scalar tensor): one scale for every row, values beyond it saturate;
    None: each row's own scale, its largest magnitude mapped to FP8_MAX (dynamic per-token).
    On a GPU one Triton launch reads x once (rows up to ONE_PASS_MAX) or twice and writes q and the
    scales (the activations of every FP8 GEMM pass through here: the torch ops took six passes over a
    float32 copy of x); elsewhere quantize_fp8_rows_reference, which gives the same values. use_kernel:
    take the Triton launch (True; under the interpreter on a CPU, for its tests) or the reference
    (False) whatever the device.
    """
    kernel = (isinstance(x, torch.Tensor) and x.is_cuda) if use_kernel is None else use_kernel
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, for_kernel=kernel)
    if static_scale is not None:
        check_tensor("static_scale", static_scale, dtypes=(torch.float32,), device=x.device, for_kernel=kernel)
        if static_scale.numel() != 1:
            raise ValueError(f"static_scale must hold one value, got shape {tuple(static_scale.shape)}")
    if not kernel or x.shape[0] == 0:
        return quantize_fp8_rows_reference(x, static_scale)
    check_last_dim_contiguous("x", x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    one_pass = k <= ONE_PASS_MAX
    block = max(triton.next_power_of_2(k), 16) if one_pass else 2048
    _quantize_rows[(m,)](
        x,
        q,
        scale,
        static_scale if static_scale is not None else scale,
        k,
        x.stride(0),
        q.stride(0),
        STATIC=static_scale is not None,
        BLOCK=block,
        ONE_PASS=one_pass,
        num_warps=min(16, max(4, block // 512)),
        **pdl_options(x.device),
    )
    return q, scale


def quantize_fp8_rows_reference(
    x: torch.Tensor, static_scale: torch.Tensor | None = None, *, exact_division: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_rows in torch ops. The scale and its reciprocal are divisions computed in float64
    and rounded to float32, which is the correctly rounded float32 quotient on every device (torch's
    CUDA division by a scalar multiplies by its reciprocal instead: the last bit differed on the H200).

    exact_division: x / scale correctly rounded, as llm-compressor quantizes weights (Fp8Linear's
    fp8-at-load), instead of x times the scale's reciprocal (the kernel's, as vLLM quantizes per-token
    activations). They differ where a quotient lies within a float32 unit of the point halfway between
    two e4m3 values: about one value in a million."""
    x32 = x.float()
    if static_scale is None:
        scale = (x32.abs().amax(dim=-1).clamp(min=1e-12).double() / FP8_MAX).float()
    else:
        scale = static_scale.float().reshape(1).expand(x.shape[0])
    scaled = x32 / scale[:, None] if exact_division else x32 * (1.0 / scale.double()).float()[:, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.contiguous()
