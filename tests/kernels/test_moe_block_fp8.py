"""The block FP8 MoE kernels (kernels.moe.block_fp8) against their torch reference, which is checked
in turn against the float experts (models.moe.experts_reference) on the dequantised weights."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.moe.block_fp8 import experts_block_fp8_reference, fused_moe_block_fp8
from gpuworker.kernels.moe.decode import route_reference
from gpuworker.kernels.quant.block_fp8_matmul import dequantize_block_fp8
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE, FP8_MAX
from gpuworker.models.moe import experts_reference
from tests.kernels.conftest import DEVICE, ON_CUDA

# (hidden, expert intermediate, experts, block): on the interpreter sizes that end inside a block
# (the intermediate 80 in blocks of 32 rows: gate's last block and up's first are separate blocks).
SHAPES = (
    [(200, 80, 4, (32, 32)), (256, 128, 6, (128, 128))]
    if not ON_CUDA
    else [(7168, 2048, 32, (128, 128)), (200, 80, 4, (32, 32))]
)


def _block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, C] -> (e4m3 [R, C], float32 block scales), each block's largest magnitude at FP8_MAX."""
    rows, cols = block
    r, c = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -c % cols, 0, -r % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(padded.shape)
    return q[:r, :c].contiguous(), scale


def problem(tokens, hidden, inter, experts, top_k, block, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13, w13_scale, w2, w2_scale = [], [], [], []
    for _ in range(experts):
        gate, up = (torch.randn(2, inter, hidden, generator=g) / hidden**0.5).unbind(0)
        (gate_q, gate_s), (up_q, up_s) = _block_fp8(gate, block), _block_fp8(up, block)
        w13.append(torch.cat([gate_q, up_q]))
        w13_scale.append(torch.cat([gate_s, up_s]))
        down_q, down_s = _block_fp8(torch.randn(hidden, inter, generator=g) / inter**0.5, block)
        w2.append(down_q)
        w2_scale.append(down_s)
    logits = torch.randn(tokens, experts, generator=g)
    if tokens > 2:
        logits[:, 0] -= 100.0  # expert 0 gets no token
    weights, ids = route_reference(logits, top_k, normalize=True)
    operands = (x, torch.stack(w13), torch.stack(w13_scale), torch.stack(w2), torch.stack(w2_scale), weights, ids)
    return [t.to(DEVICE) for t in operands]


# Kernel and reference sum in other orders: a gate or up value a rounding step off can land the
# SiLU-and-mul output on the other side of an e4m3 rounding point, moving that input to down by 1/16
# and with it the token's whole output row. So most rows agree to the dtype's rounding, and every row
# to a few percent.
TIGHT = {torch.float32: {"atol": 2e-4, "rtol": 2e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
LOOSE = {"atol": 8e-2, "rtol": 5e-2}


def assert_close_but_for_rounding_flips(got, expected, dtype):
    torch.testing.assert_close(got, expected, **LOOSE)
    if dtype == torch.bfloat16 and not ON_CUDA:
        # The interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest): half
        # the SiLU-and-mul outputs are a bfloat16 step off torch's, and many of them cross an e4m3
        # rounding point. The error stays a few percent on average.
        assert (got.float() - expected.float()).abs().mean() <= 0.05 * expected.float().abs().mean()
        return
    rows_close = torch.isclose(got.float(), expected.float(), **TIGHT[dtype]).all(dim=1)
    assert rows_close.float().mean() >= 0.9, f"{int((~rows_close).sum())} of {len(rows_close)} rows differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 2), (37, 3)])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_match_the_reference(shape, tokens, top_k, dtype):
    hidden, inter, experts, block = shape
    operands = problem(tokens, hidden, inter, experts, top_k, block, dtype)
    got = fused_moe_block_fp8(*operands, block)
    expected = experts_block_fp8_reference(*operands, block)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    assert_close_but_for_rounding_flips(got, expected, dtype)


def test_expert_parallel_rank_computes_only_its_experts():
    hidden, inter, experts, block = SHAPES[0]
    x, w13, w13_s, w2, w2_s, weights, ids = problem(20, hidden, inter, experts, 2, block, torch.float32, seed=3)
    # Two ranks of two experts each: their parts add up to the whole.
    parts = [
        fused_moe_block_fp8(x, w13[r : r + 2], w13_s[r : r + 2], w2[r : r + 2], w2_s[r : r + 2], weights, ids, block, r)
        for r in (0, 2)
    ]
    whole = fused_moe_block_fp8(x, w13, w13_s, w2, w2_s, weights, ids, block)
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_reference_is_the_float_experts_on_dequantised_weights():
    # Checked against models.moe.experts_reference: the only differences are the FP8 rounding of
    # each projection's input, so with inputs already on the FP8 grid of their groups (x, and
    # activations within e4m3's precision) the two agree closely.
    hidden, inter, experts, block = SHAPES[0]
    x, w13, w13_s, w2, w2_s, weights, ids = [
        t.cpu() for t in problem(9, hidden, inter, experts, 2, block, torch.float32)
    ]
    group_n, group_k = block
    up_row = -(-inter // group_n)
    w13_f = torch.stack(
        [
            torch.cat(
                [
                    dequantize_block_fp8(w13[e, :inter], w13_s[e, :up_row], group_n, group_k),
                    dequantize_block_fp8(w13[e, inter:], w13_s[e, up_row:], group_n, group_k),
                ]
            )
            for e in range(experts)
        ]
    )
    w2_f = torch.stack([dequantize_block_fp8(w2[e], w2_s[e], group_n, group_k) for e in range(experts)])
    dense = experts_reference(x, w13_f, w2_f, weights, ids)
    quantized = experts_block_fp8_reference(x, w13, w13_s, w2, w2_s, weights, ids, block)
    # e4m3 keeps 3 mantissa bits: inputs move by up to 1/16 each, outputs by a few percent of their size.
    assert (quantized - dense).abs().max() <= 0.1 * dense.abs().max()
    assert (quantized - dense).abs().max() > 0  # activations are rounded, not passed through


def test_bad_operands_are_named():
    hidden, inter, experts, block = SHAPES[0]
    x, w13, w13_s, w2, w2_s, weights, ids = problem(3, hidden, inter, experts, 2, block, torch.float32)
    with pytest.raises(ValueError, match="w13_scale must have shape"):
        fused_moe_block_fp8(x, w13, w13_s[:, :1], w2, w2_s, weights, ids, block)
    with pytest.raises(ValueError, match="w13 must have dtype"):
        fused_moe_block_fp8(x, w13.float(), w13_s, w2, w2_s, weights, ids, block)
    with pytest.raises(ValueError, match=r"block must be \[rows >= 1, columns a power of two >= 16\]"):
        fused_moe_block_fp8(x, w13, w13_s, w2, w2_s, weights, ids, (32, 48))
