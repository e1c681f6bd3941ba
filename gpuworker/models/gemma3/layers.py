"""Gemma 3's building blocks: its RMSNorm (x * (1 + weight), in float32) and its GELU-tanh gated MLP.

On the GPU both run the llama path's fused kernels with their Gemma switch (kernels.norm.rms_norm's
gemma, kernels.linear.activation's gelu_tanh_and_mul); on the CPU, torch ops computing exactly what
transformers' Gemma3RMSNorm and Gemma3MLP compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuworker.models.layers import GatedMLP, RMSNorm


class GemmaRMSNorm(RMSNorm):
    """norm(x) * (1 + weight), computed in float32 and cast back once (not Llama's x.to(dtype) * w)."""

    # The weight a dummy load fills it with: 0 is the identity scale here (1 for Llama's norm).
    unit_weight = 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            raise ValueError("GemmaRMSNorm takes no residual: Gemma adds it after the post-norms")
        if x.is_cuda and x.stride(-1) == 1:
            from gpuworker.kernels.norm.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, gemma=True)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GeluGatedMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda:  # one kernel instead of gelu, then the product
            from gpuworker.kernels.linear.activation import gelu_tanh_and_mul

            return self.down_proj(gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
