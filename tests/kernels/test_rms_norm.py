"""rms_norm against its torch reference (written as transformers' LlamaRMSNorm), with and without residual."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.rms_norm import MAX_HIDDEN, rms_norm, rms_norm_reference

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
    torch.testing.assert_close(rms_norm(q, weight, 1e-6), rms_norm_reference(q, weight, 1e-6),
                               **tolerance(torch.bfloat16))


def test_weight_dtype_promotes_like_eager(device, generator, tolerance):
    x = torch.randn(4, 64, generator=generator).bfloat16().to(device)
    weight = torch.randn(64, generator=generator).to(device)  # float32 weight
    got = rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_reference(x, weight, 1e-5), **tolerance(torch.bfloat16))


def test_single_row_and_four_dims(device, generator, tolerance):
    x = torch.randn(2, 2, 3, 40, generator=generator).to(device)
    weight = torch.randn(40, generator=generator).to(device)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5),
                               **tolerance(torch.float32))
    torch.testing.assert_close(rms_norm(x[0, 0, 0], weight, 1e-5), rms_norm_reference(x[0, 0, 0], weight, 1e-5),
                               **tolerance(torch.float32))


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
