"""silu_and_mul against its torch reference (transformers' LlamaMLP activation)."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.linear.activation import MAX_FP8_ROW, silu_and_mul, silu_and_mul_fp8, silu_and_mul_reference
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE, quantize_fp8_rows

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


@pytest.mark.parametrize("intermediate", [40, 1500, 14336])
def test_fp8_output_is_the_quantized_product_bit_for_bit(intermediate, device, generator):
    # The down projection's FP8 input quantized in the same launch, one program a row: the same bytes
    # and scales as quantize_fp8_rows of silu_and_mul's bfloat16 output (widths past a power of 2).
    gate_up = (3 * torch.randn(4, 2 * intermediate, generator=generator)).to(torch.bfloat16).to(device)
    gate_up[2] = 0
    q, scale = silu_and_mul_fp8(gate_up)
    q_ref, scale_ref = quantize_fp8_rows(silu_and_mul(gate_up), use_kernel=True)
    assert q.dtype == FP8_DTYPE and q.shape == (4, intermediate) and scale.shape == (4,)
    assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


def test_fp8_output_refuses_rows_wider_than_a_program(device):
    with pytest.raises(ValueError, match="exceeds the FP8 launch's row"):
        silu_and_mul_fp8(torch.zeros(1, 2 * (MAX_FP8_ROW + 16), device=device))
