"""INT8 W8A8 GEMM: out [M, N] = (x_q * x_scale) @ (weight * weight_scale)^T (+ bias), for INT8
checkpoints (compressed-tensors "int-quantized"), and the per-token INT8 quantizer of its input.

Both operands are int8; their products are summed exactly in int32 (Hopper's and Ampere's INT8
tensor cores), then scaled once per tile by the activations' float32 scale per row and the weight's
float32 scale per output channel, and written in a float dtype. Symmetric scales only: no zero points.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuworker.kernels.device import matmul_tile
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_operand,
    check_tensor,
    interpreting,
    lazy_jit,
    pdl_options,
)

INT8_MAX = 127.0
INT8_MIN = -128.0
_INT8_MAX = tl.constexpr(INT8_MAX)
_INT8_MIN = tl.constexpr(INT8_MIN)


def _int8_matmul_kernel(
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
    HAS_BIAS: tl.constexpr,
    INTERPRETER_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m, offs_n, offs_k, m_mask, n_mask = matmul_tile.offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0,
        )
        # The weight tile transposed: [BLOCK_K, BLOCK_N] of rows of the [N, K] weight.
        w = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        if INTERPRETER_DOT:
            # The interpreter's dot takes no int8 inputs. In float32 a tile's sum is still exact: each
            # product is at most 2^14, so BLOCK_K (<= 1,024) of them stay within float32's 2^24.
            tile = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            acc += tile.to(tl.int32)
        else:
            acc = tl.dot(x, w, acc, out_dtype=tl.int32)
    out = acc.to(tl.float32)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
    out = out * x_scale[:, None] * w_scale[None, :]
    out = matmul_tile.add_bias(out, bias_ptr, offs_n, n_mask, HAS_BIAS)
    matmul_tile.store(out_ptr, out, stride_om, offs_m, offs_n, m_mask, n_mask)


_int8_matmul = lazy_jit(_int8_matmul_kernel, do_not_specialize=("M",))


def int8_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x [M, K] int8 with x_scale [M] float32 @ (weight [N, K] int8 * weight_scale [N] float32)^T
    (+ bias [N] in out_dtype) -> [M, N] in out_dtype, the products summed in int32."""
    check_tensor("x", x, ndim=2, dtypes=(torch.int8,))
    check_tensor("weight", weight, ndim=2, dtypes=(torch.int8,), device=x.device)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns but x has {k}")
    check_operand("x_scale", x_scale, (m,), torch.float32, x.device)
    check_operand("weight_scale", weight_scale, (n,), torch.float32, x.device)
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
    _int8_matmul[(-(-m // block_m), -(-n // block_n))](
        x,
        x_scale,
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
        HAS_BIAS=bias is not None,
        INTERPRETER_DOT=interpreting(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        **pdl_options(x.device),
    )
    return out


def _tiles(m: int, on_cuda: bool) -> tuple[int, int, int]:
    """BLOCK_M, BLOCK_N, BLOCK_K: INT8 MMAs take at least 16 rows and 32 deep; wider tiles for bigger
    batches. Generic tiles for any GPU: no sweep measures them yet, so they have no per-device table
    (gpuworker/kernels/configs)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return (block_m, 128, 128) if on_cuda else (block_m, 32, 32)


def int8_matmul_reference(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Pure torch: the int32 sums as int64 matmul (exact), then the scales and bias in float32."""
    sums = (x.to(torch.int64) @ weight.to(torch.int64).t()).float()
    out = sums * x_scale.float()[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _quantize_int8_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    # One row per program: its largest magnitude mapped to 127 (a correctly rounded division, once a
    # row), then x times the scale's reciprocal rounded to the nearest integer, ties to even, as
    # quantize_int8_rows_reference computes it. Long rows are read twice (amax, then values).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), _INT8_MAX)
    inverse = tl.math.div_rn(1.0, scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(_round_half_even(x * inverse), _INT8_MIN, _INT8_MAX)
        tl.store(q_row + k0 + offs, q.to(tl.int8), mask=mask)


@triton.jit
def _round_half_even(x):
    """float32 x (|x| < 2^22) rounded to the nearest integer, ties to even: adding 1.5 * 2^23 leaves a
    float32 whose last place is 1, so the addition rounds; subtracting gives it back exactly."""
    return (x + 12582912.0) - 12582912.0


_quantize_int8_rows = lazy_jit(_quantize_int8_rows_kernel)


def quantize_int8_rows(x: torch.Tensor, *, use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (int8 [M, K], float32 scale [M]) with x ~= q * scale per row (dynamic per-token,
    symmetric: each row's largest magnitude maps to 127). On a GPU one Triton launch; elsewhere
    quantize_int8_rows_reference, which gives the same values. use_kernel: take the Triton launch
    (True; under the interpreter on a CPU, for its tests) or the reference (False) whatever the device."""
    kernel = (isinstance(x, torch.Tensor) and x.is_cuda) if use_kernel is None else use_kernel
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, for_kernel=kernel)
    if not kernel or x.shape[0] == 0:
        return quantize_int8_rows_reference(x)
    check_last_dim_contiguous("x", x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    block = min(max(triton.next_power_of_2(k), 16), 4096)
    _quantize_int8_rows[(m,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        BLOCK=block,
        num_warps=min(16, max(4, block // 512)),
        **pdl_options(x.device),
    )
    return q, scale


def quantize_int8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_rows in torch ops. The scale and its reciprocal are divisions computed in float64
    and rounded to float32 (the correctly rounded float32 quotient on every device); each value is x
    times the reciprocal, rounded half to even (vLLM's per-token INT8 quantizer multiplies likewise)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1).clamp(min=1e-12).double() / INT8_MAX).float()
    inverse = (1.0 / scale.double()).float()
    q = torch.round(x32 * inverse[:, None]).clamp(INT8_MIN, INT8_MAX).to(torch.int8)
    return q, scale.contiguous()
