"""fp8_matmul against its torch reference: float and FP8 activations, per-row activation scales,
bias, ragged tiles, batch 1 to 256 on the GPU."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels import launch as launch_module
from gpuworker.kernels.quant import fp8_matmul as fp8_module
from gpuworker.kernels.quant.fp8_matmul import (
    FP8_DTYPE,
    FP8_MAX,
    fp8_matmul,
    fp8_matmul_reference,
    quantize_fp8_rows,
    quantize_fp8_rows_reference,
)
from tests.kernels.conftest import FLOAT32_LONG_SUMS

ON_CUDA = torch.cuda.is_available()
# Llama-3-8B's qkv projection on the GPU; sizes that are not multiples of the tiles elsewhere.
N, K = (6144, 4096) if ON_CUDA else (72, 80)
ROWS = (1, 16, 17, 256) if ON_CUDA else (1, 17, 40)


def _tolerance(tolerance, dtype):
    # K = 4096 on the GPU.
    return FLOAT32_LONG_SUMS if dtype == torch.float32 and ON_CUDA else tolerance(dtype)


def _weight(generator, device):
    weight = torch.randn(N, K, generator=generator) / K**0.5
    q, scale = quantize_fp8_rows(weight)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_float_activations(rows, dtype, device, generator, tolerance):
    weight, scale = _weight(generator, device)
    x = torch.randn(rows, K, generator=generator).to(dtype).to(device)
    bias = torch.randn(N, generator=generator).to(dtype).to(device)
    got = fp8_matmul(x, weight, scale, bias=bias)
    assert got.shape == (rows, N) and got.dtype == dtype
    torch.testing.assert_close(got, fp8_matmul_reference(x, weight, scale, bias=bias), **_tolerance(tolerance, dtype))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_fp8_activations(rows, dtype, static, device, generator, tolerance):
    weight, scale = _weight(generator, device)
    x = torch.randn(rows, K, generator=generator).to(dtype).to(device)
    x_q, x_scale = quantize_fp8_rows(x, torch.tensor(3.0 / FP8_MAX, device=device) if static else None)
    got = fp8_matmul(x_q, weight, scale, x_scale=x_scale, out_dtype=dtype)
    expected = fp8_matmul_reference(x_q, weight, scale, x_scale=x_scale, out_dtype=dtype)
    # Hopper's FP8 MMAs sum a 128-product K tile with fewer bits than float32 (the kernel adds the
    # tiles in float32): up to 8.6e-4 off at K = 4096 on the H200 (2.3e-2 with the sum left in the MMA).
    fp8_mma = {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float32 and ON_CUDA else _tolerance(tolerance, dtype)
    torch.testing.assert_close(got, expected, **fp8_mma)


def test_quantize_rows(device):
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [896.0, 1.0, -448.0]], device=device)
    q, scale = quantize_fp8_rows(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    # Each row's largest magnitude maps to FP8_MAX; an all-zero row stays zero (no division by zero).
    torch.testing.assert_close(q.float().abs().amax(dim=1), torch.tensor([FP8_MAX, 0.0, FP8_MAX], device=device))
    torch.testing.assert_close(q.float() * scale[:, None], x, rtol=0.07, atol=0)
    # A static scale saturates what lies beyond it.
    q, scale = quantize_fp8_rows(x, torch.tensor(1.0, device=device))
    assert q.float().amax().item() == FP8_MAX and scale.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
def test_quantize_rows_kernel_gives_the_references_bytes(dtype, static, one_pass, device, generator, monkeypatch):
    # K past one block (2,048) with a tail, held whole in registers or read twice in blocks; rows of
    # very different magnitudes, one all zero, one with values the static scale saturates.
    if not one_pass:
        monkeypatch.setattr(fp8_module, "ONE_PASS_MAX", 1024)
    k = 3000 if not ON_CUDA else 14336
    x = torch.randn(5, k, generator=generator) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 500.0])[:, None]
    x = x.to(dtype).to(device)
    static_scale = torch.tensor(0.5, device=device) if static else None
    q, scale = quantize_fp8_rows(x, static_scale, use_kernel=True)
    q_ref, scale_ref = quantize_fp8_rows_reference(x, static_scale)
    assert q.shape == x.shape and q.dtype == FP8_DTYPE and scale.shape == (5,)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())  # the same values (a zero may lose its sign)


def test_quantize_rows_of_a_host_tensor_take_torch_ops(monkeypatch, generator):
    # A CPU tensor on a machine whose kernels run on the GPU (no interpreter): quantizing a host
    # checkpoint, or a test's weights, takes the reference instead of refusing the tensor.
    monkeypatch.setattr(launch_module, "interpreting", lambda: False)
    x = torch.randn(3, 64, generator=generator)
    for static_scale in (None, torch.tensor(0.01)):
        q, scale = quantize_fp8_rows(x, static_scale)
        q_ref, scale_ref = quantize_fp8_rows_reference(x, static_scale)
        assert torch.equal(q.float(), q_ref.float()) and torch.equal(scale, scale_ref)


def test_quantize_rows_takes_strided_rows(device, generator):
    x = torch.randn(4, 96, generator=generator).to(device)[:, :80]
    q, scale = quantize_fp8_rows(x, use_kernel=True)
    q_ref, scale_ref = quantize_fp8_rows_reference(x)
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(scale, scale_ref)


def test_bad_input_is_named(device):
    weight = torch.zeros(8, 16, device=device).to(FP8_DTYPE)
    scale = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="weight has 16 columns"):
        fp8_matmul(torch.zeros(2, 8, device=device), weight, scale)
    with pytest.raises(ValueError, match="x_scale is required"):
        fp8_matmul(torch.zeros(2, 16, device=device).to(FP8_DTYPE), weight, scale, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        fp8_matmul(torch.zeros(2, 16, device=device), weight, torch.ones(1, device=device))
    with pytest.raises(ValueError, match="weight must have dtype"):
        fp8_matmul(torch.zeros(2, 16, device=device), weight.float(), scale)


def test_no_rows(device):
    weight = torch.zeros(8, 16, device=device).to(FP8_DTYPE)
    assert fp8_matmul(torch.zeros(0, 16, device=device), weight, torch.ones(8, device=device)).shape == (0, 8)
