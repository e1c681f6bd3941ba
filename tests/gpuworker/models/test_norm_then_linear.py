"""norm_then_linear: the decoder's pre-norm + projection, fused into one GEMV for a decode row on
tuned shapes (CUDA), the plain RMSNorm then Linear everywhere else; a dynamic FP8 projection takes its
input quantized by the norm (and the down projection by SiLU-and-mul)."""

from __future__ import annotations

import pytest
import torch

from gpuworker.checkpoint_quantization import QuantConfig
from gpuworker.kernels.linear import gemv as gemv_module
from gpuworker.models.layers import GatedMLP, Linear, RMSNorm, norm_then_linear
from gpuworker.models.quantization import fp8 as fp8_module
from gpuworker.models.quantization.fp8 import Fp8Linear

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path runs on CUDA only")
@pytest.mark.parametrize("with_residual", [False, True])
def test_cuda_decode_row_takes_one_fused_kernel(monkeypatch, kernel_configs, with_residual):
    norm, linear, x, residual = build(torch.bfloat16, "cuda")
    residual = residual if with_residual else None
    kernel_configs(
        "gemv",
        gemv_module.TABLE_KEY,
        [dict(weight_dtype="bfloat16", n=OUT, k=HIDDEN, m=1, config="fma-n16-k512-w4-p1")],
        device=x.device,
    )
    calls = []
    fused = gemv_module.gemv_rms_norm
    monkeypatch.setattr(gemv_module, "gemv_rms_norm", lambda *a, **k: calls.append(1) or fused(*a, **k))

    out, stream = norm_then_linear(norm, linear, x, residual)

    assert calls, "the fused kernel was not used"
    normed, expected_stream = norm(x, residual) if with_residual else (norm(x), x)
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(out, torch.nn.functional.linear(normed, linear.weight), atol=2e-2, rtol=2e-2)


def _fp8_projection(in_features, out_features, bias=False):
    quant = QuantConfig(method="fp8", checkpoint_format="fp8-at-load", activation_scheme="dynamic")
    linear = Fp8Linear(in_features, out_features, bias, quant, ("proj",), (out_features,))
    linear.fill_dummy(torch.Generator().manual_seed(1))
    if bias:
        linear.bias.copy_(torch.randn(out_features, generator=torch.Generator().manual_seed(2)))
    return linear.to(torch.float32)


@pytest.mark.parametrize("with_residual", [False, True])
def test_a_dynamic_fp8_projection_takes_the_norms_fp8_output(monkeypatch, with_residual):
    # Where the row-wise scaled GEMM runs (Hopper; here the gate is opened on the CPU, whose
    # torch._scaled_mm takes the same row scales, with the kernels under the interpreter), the norm
    # quantizes its own output: no quantize_fp8_rows launch, the same result as the unfused pair.
    # float32: the interpreter rounds float32 to bfloat16 toward zero, the GPU and torch to nearest.
    norm, _, x, residual = build(torch.float32, "cpu")
    x = x.expand(24, HIDDEN).contiguous()  # past SCALED_MM_MIN_ROWS
    residual = residual.expand(24, HIDDEN).contiguous() if with_residual else None
    linear = _fp8_projection(HIDDEN, OUT, bias=True)
    unfused_out, unfused_stream = norm_then_linear(norm, linear, x, residual)

    monkeypatch.setattr(Fp8Linear, "takes_quantized_input", lambda self, t: True)
    monkeypatch.setattr(fp8_module, "quantize_fp8_rows", lambda *a, **k: pytest.fail("quantized twice"))
    out, stream = norm_then_linear(norm, linear, x, residual)

    assert torch.equal(stream, unfused_stream)
    torch.testing.assert_close(out, unfused_out, atol=2e-2, rtol=2e-2)


def test_a_dynamic_fp8_down_projection_takes_silu_and_muls_fp8_output(monkeypatch):
    mlp = GatedMLP(HIDDEN, OUT, bias=False)
    mlp.down_proj = _fp8_projection(OUT, HIDDEN)
    gate_up = torch.randn(24, 2 * OUT, generator=torch.Generator().manual_seed(3))
    unfused = mlp.down(gate_up)

    monkeypatch.setattr(Fp8Linear, "takes_quantized_input", lambda self, t: True)
    monkeypatch.setattr(fp8_module, "quantize_fp8_rows", lambda *a, **k: pytest.fail("quantized twice"))
    torch.testing.assert_close(mlp.down(gate_up), unfused, atol=2e-2, rtol=2e-2)


def test_only_dynamic_fp8_projections_on_the_scaled_gemm_take_quantized_input():
    x = torch.zeros(24, HIDDEN, dtype=torch.bfloat16)
    assert not _fp8_projection(HIDDEN, OUT).takes_quantized_input(x)  # not on a GPU
    static = Fp8Linear(
        HIDDEN,
        OUT,
        False,
        QuantConfig(method="fp8", checkpoint_format="compressed-tensors", activation_scheme="static"),
        ("proj",),
        (OUT,),
    )
    assert not static.takes_quantized_input(x)
