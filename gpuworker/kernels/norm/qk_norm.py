"""Qwen3's per-head RMSNorm of the queries and keys (q_norm, k_norm), applied inside the rotary
launches (kernels.rotary, and the decode attention's NewTokens) instead of as two norm launches.

This module holds the host side (QKNorm, its checks, the torch reference); head_norm.py the
kernels' helpers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpuworker.kernels.launch import check_last_dim_contiguous, check_shape, check_tensor
from gpuworker.kernels.norm.rms_norm import rms_norm_reference


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
        raise ValueError(
            f"qk_norm needs rotary over the whole head: cos_cache's width {half} must be "
            f"head_dim // 2 = {head_dim // 2}"
        )
    if not qk_norm.eps > 0:
        raise ValueError(f"qk_norm.eps must be > 0, got {qk_norm.eps}")


def qk_norm_reference(qk_norm: QKNorm, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference (out of place): transformers' RMSNorm over each head."""
    return (
        rms_norm_reference(query, qk_norm.q_weight, qk_norm.eps),
        rms_norm_reference(key, qk_norm.k_weight, qk_norm.eps),
    )
