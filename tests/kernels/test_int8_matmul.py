"""int8_matmul and quantize_int8_rows against their torch references: exact int32 sums scaled per row
and per channel, bias, ragged tiles, output dtypes; the quantizer's bytes; bad input."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels import launch as launch_module
from gpuworker.kernels.quant.int8_matmul import (
    int8_matmul,
    int8_matmul_reference,
    quantize_int8_rows,
    quantize_int8_rows_reference,
)

ON_CUDA = torch.cuda.is_available()
# Llama-3-8B's qkv projection on the GPU; sizes that are not multiples of the tiles elsewhere.
N, K = (6144, 4096) if ON_CUDA else (72, 80)
ROWS = (1, 16, 17, 256) if ON_CUDA else (1, 17, 40)


def _weight(generator, device):
    weight = torch.randn(N, K, generator=generator) / K**0.5
    q, scale = quantize_int8_rows_reference(weight)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_int8_activations(rows, dtype, with_bias, device, generator, tolerance):
    weight, scale = _weight(generator, device)
    x = torch.randn(rows, K, generator=generator).to(dtype).to(device)
    bias = torch.randn(N, generator=generator).to(dtype).to(device) if with_bias else None
    x_q, x_scale = quantize_int8_rows(x)
    got = int8_matmul(x_q, x_scale, weight, scale, bias=bias, out_dtype=dtype)
    assert got.shape == (rows, N) and got.dtype == dtype
    expected = int8_matmul_reference(x_q, x_scale, weight, scale, bias=bias, out_dtype=dtype)
    # The int32 sums are exact on both sides: only the scaling's float32 rounding and the output's may differ.
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def test_sums_are_exact_integers(device):
    # Every product at its extreme: an int32 sum a float32 accumulator would round (K * 127 * 128 > 2^24
    # needs K > 1,032; here the sum is odd and beyond 2^24).
    k = 2048 + 16
    x = torch.full((2, k), 127, dtype=torch.int8)
    x[1, 0] = -128
    weight = torch.full((3, k), -128, dtype=torch.int8)
    weight[:, 1] = 1
    ones = torch.ones(2), torch.ones(3)
    got = int8_matmul(x.to(device), ones[0].to(device), weight.to(device), ones[1].to(device), out_dtype=torch.float32)
    # The exact integer rounded once to float32: what the kernel's int32 sum converts to.
    expected = (x.to(torch.int64) @ weight.to(torch.int64).t()).double().float()
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantize_rows_kernel_gives_the_references_bytes(dtype, device, generator):
    # K past one block (4,096) with a tail; rows of very different magnitudes, one all zero, one with
    # exact halves (ties round to even).
    k = 5000 if not ON_CUDA else 14336
    x = torch.randn(6, k, generator=generator) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 500.0, 1.0])[:, None]
    x[5] = torch.arange(k) % 8 - 3.5
    x[5, 0] = 127.0  # scale 1: x * 1 keeps the halves, which round to the even integer
    x = x.to(dtype).to(device)
    q, scale = quantize_int8_rows(x, use_kernel=True)
    q_ref, scale_ref = quantize_int8_rows_reference(x)
    assert q.shape == x.shape and q.dtype == torch.int8 and scale.shape == (6,)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)
    assert q[5, :8].tolist() == [127, -2, -2, 0, 0, 2, 2, 4]
    # Each row's largest magnitude maps to 127; an all-zero row stays zero (no division by zero).
    assert q.abs().amax(dim=1).tolist() == [127, 127, 127, 0, 127, 127]


def test_quantize_rows_takes_strided_rows(device, generator):
    x = torch.randn(4, 96, generator=generator).to(device)[:, :80]
    q, scale = quantize_int8_rows(x, use_kernel=True)
    q_ref, scale_ref = quantize_int8_rows_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_quantize_rows_of_a_host_tensor_take_torch_ops(monkeypatch, generator):
    monkeypatch.setattr(launch_module, "interpreting", lambda: False)
    x = torch.randn(3, 64, generator=generator)
    q, scale = quantize_int8_rows(x)
    q_ref, scale_ref = quantize_int8_rows_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_bad_input_is_named(device):
    weight = torch.zeros(8, 16, dtype=torch.int8, device=device)
    scale = torch.ones(8, device=device)
    x = torch.zeros(2, 16, dtype=torch.int8, device=device)
    x_scale = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="weight has 16 columns"):
        int8_matmul(x[:, :8].contiguous(), x_scale, weight, scale)
    with pytest.raises(ValueError, match="x must have dtype"):
        int8_matmul(x.float(), x_scale, weight, scale)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        int8_matmul(x, x_scale, weight, torch.ones(1, device=device))
    with pytest.raises(ValueError, match="x_scale must have shape"):
        int8_matmul(x, torch.ones(3, device=device), weight, scale)
    with pytest.raises(ValueError, match="out_dtype must be a float dtype"):
        int8_matmul(x, x_scale, weight, scale, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="x must have dtype"):
        quantize_int8_rows(x, use_kernel=True)


def test_no_rows(device):
    weight = torch.zeros(8, 16, dtype=torch.int8, device=device)
    empty = torch.zeros(0, 16, dtype=torch.int8, device=device)
    got = int8_matmul(empty, torch.ones(0, device=device), weight, torch.ones(8, device=device))
    assert got.shape == (0, 8)
