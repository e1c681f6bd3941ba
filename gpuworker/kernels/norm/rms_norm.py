"""Fused RMSNorm, optionally adding the residual stream first (one read of each, one write of each).

Numerics follow transformers' Llama (and gpuworker.models.layers.RMSNorm): the residual sum is
rounded to the activation dtype as an eager `hidden + residual` would be, the norm is computed in
float32, cast back, then multiplied by the weight in the weight's dtype. rms_norm_fp8 also quantizes
each output row to FP8 for an FP8 projection after the norm. With gemma=True, Gemma's RMSNorm
instead: the float32 norm times (1 + weight) in float32, rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gpuworker.kernels.device import fp8_codec
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_operand,
    check_shape,
    check_tensor,
    lazy_jit,
    next_power_of_2,
    pdl_options,
)
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE

# One program normalises a whole row in registers; wider rows would spill.
MAX_HIDDEN = 32768


def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    scale_ptr,
    stride_x_outer,
    stride_x_inner,
    stride_residual_outer,
    stride_residual_inner,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
    GEMMA: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options: wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    outer = tl.program_id(0)
    inner = tl.program_id(1)
    row = outer.to(tl.int64) * tl.num_programs(1) + inner  # row of the contiguous outputs
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + outer.to(tl.int64) * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + outer.to(tl.int64) * stride_residual_outer + inner * stride_residual_inner + cols,
            mask=mask,
            other=0.0,
        )
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * HIDDEN + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, 0) / HIDDEN
    if GEMMA:  # (norm * (1 + weight)) in float32, as transformers' Gemma3RMSNorm
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        out = (x32 * tl.rsqrt(variance + eps)) * (1.0 + weight.to(tl.float32))
    else:
        normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        out = normed.to(tl.float32) * weight.to(tl.float32)
    if FP8_OUT:  # the output rounded to x's dtype (as rms_norm stores it), then quantized per row
        q, scale = fp8_codec.quantize_row(out.to(x.dtype).to(tl.float32))
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * HIDDEN + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * HIDDEN + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_rms_norm = lazy_jit(_rms_norm_kernel)


def _as_3d(tensor: torch.Tensor) -> torch.Tensor:
    """View [..., H] as [outer, inner, H] without copying where the strides allow it."""
    if tensor.dim() == 1:
        return tensor.view(1, 1, -1)
    if tensor.dim() == 2:
        return tensor.unsqueeze(1)
    if tensor.dim() == 3:
        return tensor
    return tensor.reshape(-1, 1, tensor.shape[-1])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    gemma: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension of x [..., H] (strided views allowed, last dim contiguous).

    Without `residual`: returns weight * norm(x). With `residual` (same shape and dtype as x): s =
    x + residual, returns (weight * norm(s), s). Outputs are new contiguous tensors; the output dtype
    is x's dtype promoted with the weight's, as in eager torch. gemma: Gemma's norm, (1 + weight) *
    norm(x) in float32, returned in x's dtype (transformers' Gemma3RMSNorm).
    """
    _check(x, weight, residual)
    out_dtype = x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    residual_out = _launch(x, weight, eps, residual, out, None, gemma)
    return out if residual is None else (out, residual_out)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm of x [T, H] with its output quantized to FP8 per row in the same launch, the input of
    an FP8 projection: (float8_e4m3fn [T, H], float32 scale [T]), bit for bit quantize_fp8_rows of
    rms_norm's output, without writing and reading that output. With `residual`: ((q, scale), s)."""
    _check(x, weight, residual)
    if x.dim() != 2 or weight.dtype != x.dtype:
        raise ValueError(
            f"rms_norm_fp8 takes x [T, H] and a weight of x's dtype, got x {tuple(x.shape)} "
            f"{x.dtype} and weight {weight.dtype}"
        )
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    residual_out = _launch(x, weight, eps, residual, q, scale)
    return (q, scale) if residual is None else ((q, scale), residual_out)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    scale: torch.Tensor | None,
    gemma: bool = False,
) -> torch.Tensor:
    """One launch writing out (and, with scale, FP8 values and their row scales); returns the
    residual sum (out itself without a residual)."""
    hidden, device = x.shape[-1], x.device
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=device) if residual is not None else out
    if x.numel() == 0:
        return residual_out
    x3 = _as_3d(x)
    r3 = _as_3d(residual) if residual is not None else x3
    block = next_power_of_2(hidden)
    _rms_norm[(x3.shape[0], x3.shape[1])](
        x3,
        r3,
        weight,
        out,
        residual_out,
        scale if scale is not None else weight,
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        FP8_OUT=scale is not None,
        GEMMA=gemma,
        num_warps=max(1, min(16, block // 512)),
        **pdl_options(device),
    )
    return residual_out


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """x [..., H] with H <= MAX_HIDDEN, weight [H] of any float dtype, residual like x; last
    dimensions contiguous."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden size)")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"x's last dimension {hidden} exceeds the kernel's limit of {MAX_HIDDEN}")
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("weight", weight, (hidden,))
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if residual is not None:
        check_operand("residual", residual, tuple(x.shape), x.dtype, x.device)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    gemma: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference, written as transformers' LlamaRMSNorm (plus the decoder's residual add)."""
    if residual is not None:
        x = x + residual
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)
    return out if residual is None else (out, x)


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pure torch, as transformers' Gemma3RMSNorm: float32 norm times (1 + weight), cast back."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)
