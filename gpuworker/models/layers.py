"""Building blocks of the llama-style decoder: linear, RMSNorm, SiLU-gated MLP and rotary embeddings.

Parameters are allocated uninitialised (torch.empty): the loader overwrites every one of them, and
skipping nn.Linear's kaiming init keeps building an 8B-parameter model on the GPU fast. The numerics
follow transformers' Llama exactly (norms in float32, rotary in the activation dtype) so that
float32 logits agree with it to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from gpuworker.kernels.linear.gemv import gemv, tuned_config

            # A single decode row on a shape where our GEMV measured faster than cuBLAS.
            config = tuned_config(x, self.weight)
            if config is not None:
                return gemv(x, self.weight, self.bias, config=config)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual`: s = x + residual, returns (norm(s), s)."""
        if x.is_cuda:  # one fused Triton kernel instead of six eager ones (seven with the add)
            from gpuworker.kernels.norm.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers does: normalise in float32, cast back, then scale in the weight's dtype.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def norm_then_linear(
    norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(s)), s) with s = x + residual (x without one): the pre-norm and the projection
    after it. A single decode row on a shape where our GEMV runs the projection takes one kernel for
    both (gemv_rms_norm: the norm applied as the GEMV loads its input)."""
    if x.is_cuda and isinstance(linear, Linear):  # quantized projections have their own kernels
        from gpuworker.kernels.linear.gemv import fuses_rms_norm, gemv_rms_norm, tuned_config

        config = tuned_config(x, linear.weight)
        if config is not None and fuses_rms_norm(config) and x.dtype == norm.weight.dtype:
            return gemv_rms_norm(x, residual, norm.weight, norm.eps, linear.weight, linear.bias, config=config)
    if _takes_quantized_input(linear, x) and x.dtype == norm.weight.dtype:
        from gpuworker.kernels.norm.rms_norm import rms_norm_fp8

        if residual is None:
            return linear.forward_quantized(*rms_norm_fp8(x, norm.weight, norm.eps), x.dtype), x
        quantized, residual = rms_norm_fp8(x, norm.weight, norm.eps, residual)
        return linear.forward_quantized(*quantized, x.dtype), residual
    if residual is None:
        return linear(norm(x)), x
    normed, residual = norm(x, residual)
    return linear(normed), residual


def _takes_quantized_input(linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether `linear` is a dynamic FP8 projection that takes x [T, in] quantized by the kernel
    producing it (Fp8Linear.takes_quantized_input)."""
    from gpuworker.models.quantization.fp8 import Fp8Linear

    return isinstance(linear, Fp8Linear) and linear.takes_quantized_input(x)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Everything after gate_up_proj (which the decoder layer runs fused with its norm):
        down(silu(gate) * up)."""
        if _takes_quantized_input(self.down_proj, gate_up[:, : self.intermediate_size]):
            from gpuworker.kernels.linear.activation import silu_and_mul_fp8

            return self.down_proj.forward_quantized(*silu_and_mul_fp8(gate_up), gate_up.dtype)
        if gate_up.is_cuda:  # one kernel instead of silu, then the product
            from gpuworker.kernels.linear.activation import silu_and_mul
            from gpuworker.kernels.linear.gemv import gemv, tuned_config

            down = self.down_proj
            # Where our GEMV runs the down projection, it applies SiLU-and-mul as it loads its input
            # (a dense weight only: quantized projections have their own kernels).
            config = None
            if isinstance(down, Linear):
                config = tuned_config(gate_up[:, : self.intermediate_size], down.weight)
            if config is not None:
                return gemv(gate_up, down.weight, down.bias, silu_mul_input=True, config=config)
            return down(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, computed as transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") == "linear":  # positions slowed by `factor` (Gemma 3's full layers)
        return inv_freq / scaling["factor"]
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin cache indexed by position.

    The cache holds one half of the rotation ([max_positions, head_dim // 2]); HF's cos/sin are that
    half repeated twice, so the products below are bit-identical to HF's apply_rotary_pos_emb.
    head_dim here is the rotated width: less than the heads' with a partial rotary (GLM), whose first
    head_dim dims are rotated and the rest passed through, as transformers does.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_cache", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        """(Re)compute the cache on its current device, in float32 whatever the model dtype."""
        device = self.cos_cache.device
        if device.type == "meta":
            return
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos_cache = freqs.cos()
        self.sin_cache = freqs.sin()

    def _apply(self, fn, recurse=True):  # keep the cache in float32 across model.to(dtype)
        super()._apply(fn, recurse)
        self.cos_cache = self.cos_cache.float()
        self.sin_cache = self.sin_cache.float()
        return self

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, H, D]; key [T, KVH, D] -> rotated (query, key)."""
        if query.is_cuda:  # the Triton kernel rotates in place, with HF's rounding
            from gpuworker.kernels.attention.rotary import apply_rotary

            return apply_rotary(positions, query, key, self.cos_cache, self.sin_cache)
        # HF casts cos/sin to the activation dtype before multiplying; do the same.
        cos = self.cos_cache[positions].to(query.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(query.dtype).unsqueeze(1)
        return _rotate(query, cos, sin, self.head_dim), _rotate(key, cos, sin, self.head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> torch.Tensor:
    """Rotate-half over the first `width` dims of each head; the rest pass (partial rotary)."""
    if width == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2, rest = x.split([width // 2, width // 2, x.shape[-1] - width], dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
