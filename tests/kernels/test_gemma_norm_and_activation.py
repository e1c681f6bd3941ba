"""Gemma's switches of the fused norm and gated-activation kernels against transformers' modules:
RMSNorm as x * (1 + weight) in float32 (gemma=True), and GELU-tanh gating (gelu_tanh_and_mul)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from gpuworker.kernels.linear.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_reference, silu_and_mul
from gpuworker.kernels.norm.rms_norm import gemma_rms_norm_reference, rms_norm

DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_rms_norm_matches_transformers(dtype, device, generator, tolerance):
    hidden = 96
    x = (3 * torch.randn(5, hidden, generator=generator)).to(dtype).to(device)
    norm = Gemma3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(hidden, generator=generator))
    norm = norm.to(dtype).to(device)
    out = rms_norm(x, norm.weight, 1e-6, gemma=True)
    assert out.dtype == dtype
    with torch.no_grad():
        expected = norm(x)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    torch.testing.assert_close(gemma_rms_norm_reference(x, norm.weight, 1e-6), expected, rtol=0, atol=0)
    # Llama's norm (the default) scales by the weight itself: a different result.
    assert not torch.allclose(rms_norm(x, norm.weight, 1e-6).to(dtype), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_and_mul_matches_transformers(dtype, device, generator, tolerance):
    intermediate = 1500  # two column blocks, the second partial
    gate_up = (2 * torch.randn(4, 2 * intermediate, generator=generator)).to(dtype).to(device)
    out = gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    torch.testing.assert_close(gelu_tanh_and_mul_reference(gate_up), expected, rtol=0, atol=0)
    assert not torch.allclose(silu_and_mul(gate_up), expected)
