"""silu_and_mul against its torch reference (transformers' LlamaMLP activation)."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.activation import silu_and_mul, silu_and_mul_reference

ON_CUDA = torch.cuda.is_available()
# Llama-3-8B's intermediate size on the GPU; a width that is not a multiple of the block elsewhere.
NUM_TOKENS, INTERMEDIATE = (300, 14336) if ON_CUDA else (5, 1100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_reference(dtype, device, generator, tolerance):
    gate_up = (4 * torch.randn(NUM_TOKENS, 2 * INTERMEDIATE, generator=generator)).to(dtype).to(device)
    got = silu_and_mul(gate_up)
    expected = silu_and_mul_reference(gate_up)
    assert got.shape == (NUM_TOKENS, INTERMEDIATE) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def test_row_view_of_a_wider_tensor(device, generator, tolerance):
    wide = torch.randn(4, 2 * 64 + 16, generator=generator).to(device)
    gate_up = wide[:, : 2 * 64]
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **tolerance(torch.float32))


def test_bad_input_is_named(device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        silu_and_mul(torch.zeros(8, 2, device=device).t())


def test_no_tokens(device):
    assert silu_and_mul(torch.zeros(0, 8, device=device)).shape == (0, 4)
