"""rms_norm against its torch reference (written as transformers' LlamaRMSNorm), with and without residual."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.norm.rms_norm import MAX_HIDDEN, rms_norm, rms_norm_fp8, rms_norm_reference
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE, quantize_fp8_rows

ON_CUDA = torch.cuda.is_available()
# Llama-3-8B's hidden size over a prefill-sized batch on the GPU; a small odd width in the interpreter.
NUM_TOKENS, HIDDEN = (1000, 4096) if ON_CUDA else (7, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(dtype, with_residual, device, generator, tolerance):
    x = (3 * torch.randn(NUM_TOKENS, HIDDEN, generator=generator)).to(dtype).to(device)
    weight = torch.randn(HIDDEN, generator=generator).to(dtype).to(device)
    residual = torch.randn(NUM_TOKENS, HIDDEN, generator=generator).to(dtype).to(device) if with_residual else None
    x_before = x.clone()

    got = rms_norm(x, weight, 1e-5, residual)
    expected = rms_norm_reference(x, weight, 1e-5, residual)

    if with_residual:
        torch.testing.assert_close(got[1], expected[1], **tolerance(dtype))
        got, expected = got[0], expected[0]
    torch.testing.assert_close(got, expected, **tolerance(dtype))
    assert got.dtype == expected.dtype and got.is_contiguous()
    assert torch.equal(x, x_before)  # inputs are not modified


def test_strided_per_head_view_like_qwen3_qk_norm(device, generator, tolerance):
    # q/k norms normalise each head of a slice of the fused qkv output: a 3-D view with row gaps.
    tokens, heads, head_dim = (300, 32, 128) if ON_CUDA else (5, 3, 32)
    qkv = torch.randn(tokens, (heads + 4) * head_dim, generator=generator).bfloat16().to(device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = torch.randn(head_dim, generator=generator).bfloat16().to(device)
    torch.testing.assert_close(
        rms_norm(q, weight, 1e-6), rms_norm_reference(q, weight, 1e-6), **tolerance(torch.bfloat16)
    )


def test_weight_dtype_promotes_like_eager(device, generator, tolerance):
    x = torch.randn(4, 64, generator=generator).bfloat16().to(device)
    weight = torch.randn(64, generator=generator).to(device)  # float32 weight
    got = rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_reference(x, weight, 1e-5), **tolerance(torch.bfloat16))


def test_single_row_and_four_dims(device, generator, tolerance):
    x = torch.randn(2, 2, 3, 40, generator=generator).to(device)
    weight = torch.randn(40, generator=generator).to(device)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), **tolerance(torch.float32)
    )
    torch.testing.assert_close(
        rms_norm(x[0, 0, 0], weight, 1e-5), rms_norm_reference(x[0, 0, 0], weight, 1e-5), **tolerance(torch.float32)
    )


def test_rejects_bad_arguments(device):
    x = torch.zeros(3, 16, device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \(16,\)"):
        rms_norm(x, torch.zeros(8, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual must have shape"):
        rms_norm(x, torch.zeros(16, device=device), 1e-5, torch.zeros(2, 16, device=device))
    with pytest.raises(ValueError, match="residual must have dtype"):
        rms_norm(x, torch.zeros(16, device=device), 1e-5, torch.zeros(3, 16, device=device).half())
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        rms_norm(torch.zeros(16, 3, device=device).t(), torch.zeros(16, device=device), 1e-5)
    with pytest.raises(ValueError, match="exceeds the kernel's limit"):
        rms_norm(torch.zeros(1, MAX_HIDDEN + 1, device=device), torch.zeros(MAX_HIDDEN + 1, device=device), 1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [96, 4096])
def test_fp8_output_is_the_quantized_norm_bit_for_bit(with_residual, hidden, device, generator):
    # The input of an FP8 projection quantized in the norm's own launch: the same bytes and scales as
    # quantize_fp8_rows of rms_norm's bfloat16 output (a row all zero included), the same residual sum.
    x = (4 * torch.randn(5, hidden, generator=generator)).to(torch.bfloat16)
    x[3] = 0
    residual = torch.randn(5, hidden, generator=generator).to(torch.bfloat16) if with_residual else None
    weight = (1 + torch.rand(hidden, generator=generator)).to(torch.bfloat16)
    x, weight = x.to(device), weight.to(device)
    residual = residual.to(device) if residual is not None else None
    got = rms_norm_fp8(x, weight, 1e-5, residual)
    unfused = rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        (q, scale), stream = got
        unfused, expected_stream = unfused
        assert torch.equal(stream, expected_stream)
    else:
        q, scale = got
    q_ref, scale_ref = quantize_fp8_rows(unfused, use_kernel=True)
    assert q.dtype == FP8_DTYPE and scale.shape == (5,)
    assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


def test_fp8_output_refuses_what_it_cannot_quantize_per_row(device):
    x = torch.zeros(2, 3, 16, device=device)
    with pytest.raises(ValueError, match=r"x \[T, H\]"):
        rms_norm_fp8(x, torch.ones(16, device=device), 1e-5)
    with pytest.raises(ValueError, match="weight of x's dtype"):
        rms_norm_fp8(x[0], torch.ones(16, device=device, dtype=torch.bfloat16), 1e-5)
