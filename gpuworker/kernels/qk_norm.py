"""Qwen3's per-head RMSNorm of the queries and keys (q_norm, k_norm), applied inside the rotary
launches (kernels.rotary, and the decode attention's NewTokens) instead of as two norm launches.

Numerics as models.layers.RMSNorm: normalise in float32, round to the activation dtype, multiply by
the weight, round again. Kernels call `qk_norm.normalize(...)` and co. through the module, so the
interpreter's launches can swap in an interpretable twin (launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpuworker.kernels.launch import check_last_dim_contiguous, check_shape, check_tensor
from gpuworker.kernels.rms_norm import rms_norm_reference


@dataclass(frozen=True)
class QKNorm:
    """The norms before rotary: q_weight and k_weight [head_dim] in the activation dtype, eps as the
    model's RMSNorm."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def check_qk_norm(qk_norm: QKNorm, query: torch.Tensor, half: int) -> None:
    """A QKNorm for heads like query's [T, H, head_dim], rotated over 2 * half dims: the whole head
    (a partial rotary would leave a normalised tail to write, which no model needs)."""
    head_dim = query.shape[-1]
    for name, weight in (("q_weight", qk_norm.q_weight), ("k_weight", qk_norm.k_weight)):
        check_tensor(f"qk_norm.{name}", weight, ndim=1, dtypes=(query.dtype,), device=query.device)
        check_shape(f"qk_norm.{name}", weight, (head_dim,))
        check_last_dim_contiguous(f"qk_norm.{name}", weight)
    if 2 * half != head_dim:
        raise ValueError(f"qk_norm needs rotary over the whole head: cos_cache's width {half} must be "
                         f"head_dim // 2 = {head_dim // 2}")
    if not qk_norm.eps > 0:
        raise ValueError(f"qk_norm.eps must be > 0, got {qk_norm.eps}")


def qk_norm_reference(qk_norm: QKNorm, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference (out of place): transformers' RMSNorm over each head."""
    return (rms_norm_reference(query, qk_norm.q_weight, qk_norm.eps),
            rms_norm_reference(key, qk_norm.k_weight, qk_norm.eps))


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
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(weight_ptr + dims, mask=dim_mask, other=0.0)[None, :]
    w2 = tl.load(weight_ptr + HALF + dims, mask=dim_mask, other=0.0)[None, :]
    return normalize(x1, rstd, w1, dtype), normalize(x2, rstd, w2, dtype)
