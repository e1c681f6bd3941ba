"""The device side of qk_norm.py: Qwen3's per-head RMSNorm of queries and keys inside a kernel.

Numerics as models.layers.RMSNorm: normalise in float32, round to the activation dtype, multiply by
the weight, round again. Kernels call `head_norm.normalize_halves(...)` through the module, so
the interpreter's launches can swap in an interpretable twin (launch.py); it imports nothing of
ours, so launch.py can import it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rstd_of(sum_sq, eps, HEAD_DIM: tl.constexpr):
    """1 / rms of heads of HEAD_DIM values whose squares sum to sum_sq (float32)."""
    return tl.rsqrt(sum_sq / HEAD_DIM + eps)


@triton.jit
def normalize(x, rstd, weight, dtype):
    """x (float32, [H, W]: heads or parts of them) times its head's rstd [H, 1] = 1 / rms(head),
    rounded to dtype, times the weight (broadcast to x), rounded again, as kernels.rms_norm; in float32."""
    x = (x * rstd).to(dtype).to(tl.float32) * weight.to(tl.float32)
    return x.to(dtype).to(tl.float32)


@triton.jit
def normalize_halves(x1, x2, weight_ptr, dims, dim_mask, eps, dtype, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Heads held as their two halves, float32 [H, BLOCK_HALF] each (dims, dim_mask: a half's
    columns), normalised with the weight at weight_ptr [HEAD_DIM = 2 * HALF]; in float32."""
    rstd = rstd_of(tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1), eps, HEAD_DIM)[:, None]
    w1 = tl.load(weight_ptr + dims, mask=dim_mask, other=0.0)[None, :]
    w2 = tl.load(weight_ptr + HALF + dims, mask=dim_mask, other=0.0)[None, :]
    return normalize(x1, rstd, w1, dtype), normalize(x2, rstd, w2, dtype)
