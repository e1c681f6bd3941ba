"""norm_then_linear: the decoder's pre-norm + projection, fused into one GEMV for a decode row on
tuned shapes (CUDA), the plain RMSNorm then Linear everywhere else."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels import gemv as gemv_module
from gpuworker.models.layers import Linear, RMSNorm, norm_then_linear

HIDDEN, OUT = 256, 384


def build(dtype, device):
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(HIDDEN, 1e-5)
    linear = Linear(HIDDEN, OUT)
    norm.weight.copy_(1 + torch.rand(HIDDEN, generator=generator))
    linear.weight.copy_(torch.randn(OUT, HIDDEN, generator=generator) / HIDDEN**0.5)
    x = 3 * torch.randn(1, HIDDEN, generator=generator)
    residual = torch.randn(1, HIDDEN, generator=generator)
    return norm.to(device, dtype), linear.to(device, dtype), x.to(device, dtype), residual.to(device, dtype)


@pytest.mark.parametrize("with_residual", [False, True])
def test_cpu_is_norm_then_linear(with_residual):
    norm, linear, x, residual = build(torch.float32, "cpu")
    out, stream = norm_then_linear(norm, linear, x, residual if with_residual else None)
    expected_stream = x + residual if with_residual else x
    torch.testing.assert_close(stream, expected_stream)
    torch.testing.assert_close(out, linear(norm(expected_stream)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path runs on CUDA only")
@pytest.mark.parametrize("with_residual", [False, True])
def test_cuda_decode_row_takes_one_fused_kernel(monkeypatch, with_residual):
    norm, linear, x, residual = build(torch.bfloat16, "cuda")
    residual = residual if with_residual else None
    monkeypatch.setitem(gemv_module.TUNED, (OUT, HIDDEN), {1: "fma-n16-k512-w4-p1"})
    calls = []
    fused = gemv_module.gemv_rms_norm
    monkeypatch.setattr(gemv_module, "gemv_rms_norm", lambda *a, **k: calls.append(1) or fused(*a, **k))

    out, stream = norm_then_linear(norm, linear, x, residual)

    assert calls, "the fused kernel was not used"
    normed, expected_stream = norm(x, residual) if with_residual else (norm(x), x)
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(out, torch.nn.functional.linear(normed, linear.weight), atol=2e-2, rtol=2e-2)
