"""DeepSeek's rotary embedding of the qk_rope_head_dim part of each query and of the shared key:
plain or YaRN-scaled frequencies, cos and sin scaled by YaRN's attention factor, pairs interleaved
(DeepSeek's layout) or rotate-half, computed as transformers computes them.

Interleaved pairs come out de-interleaved (the rotated first members, then the second), as
transformers' DeepseekV3 does: queries and keys are permuted alike, so their products (the only
use of the rotated parts, cached keys included) are unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gpuworker.models.deepseek.config import MLAConfig, YarnRope


def yarn_inv_freq(dim: int, base: float, yarn: YarnRope) -> torch.Tensor:
    """transformers' _compute_yarn_parameters' inverse frequencies [dim // 2], float32."""

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(mla: MLAConfig) -> torch.Tensor:
    dim = mla.qk_rope_head_dim
    if mla.yarn is not None:
        return yarn_inv_freq(dim, mla.rope_theta, mla.yarn)
    return 1.0 / (mla.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class DeepseekRotary(nn.Module):
    """forward(positions [T], x [T, H, rope_dim]) -> x rotated; cos/sin caches [max_positions,
    rope_dim // 2] in float32, already scaled by the attention factor."""

    def __init__(self, mla: MLAConfig, max_positions: int) -> None:
        super().__init__()
        self.mla = mla
        self.max_positions = max_positions
        half = mla.qk_rope_head_dim // 2
        self.register_buffer("cos_cache", torch.empty(max_positions, half), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, half), persistent=False)
        self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        device = self.cos_cache.device
        if device.type == "meta":
            return
        inv_freq = rope_inv_freq(self.mla).to(device)
        freqs = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()[:, None] * inv_freq
        self.cos_cache = freqs.cos() * self.mla.rotary_scale
        self.sin_cache = freqs.sin() * self.mla.rotary_scale

    def _apply(self, fn, recurse=True):  # keep the cache in float32 across model.to(dtype)
        super()._apply(fn, recurse)
        self.cos_cache = self.cos_cache.float()
        self.sin_cache = self.sin_cache.float()
        return self

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the activations (transformers' DeepseekV2 rotates in float32 too).
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        x32 = x.float()
        if self.mla.rope_interleave:
            x1, x2 = x32[..., 0::2], x32[..., 1::2]
        else:
            x1, x2 = x32.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
