"""The fused MoE kernels against the torch reference (models.moe.experts_reference), and the
expert alignment they run on."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.moe.decode import route_reference
from gpuworker.kernels.moe.fused import align_by_expert, fused_moe
from gpuworker.models.moe import experts_reference
from tests.kernels.conftest import DEVICE, ON_CUDA, TOLERANCES

# (hidden, expert intermediate, experts): sizes not multiples of the tiles, so the masks are used.
SHAPES = [(64, 48, 4), (96, 80, 8)] if not ON_CUDA else [(64, 48, 4), (2048, 768, 128), (4096, 14336, 8)]


def problem(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    if tokens > 2:
        logits[:, 0] -= 100.0  # expert 0 gets no token: an empty run in the middle of nothing
    weights, ids = route_reference(logits, top_k, normalize=True)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 4), (7, 2, 8), (50, 3, 5), (33, 1, 16)])
def test_alignment_groups_every_pair_once_by_expert(tokens, top_k, experts, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    pair_of_row, expert_of_block = align_by_expert(ids, experts, block_m)
    num_pairs = tokens * top_k
    assert pair_of_row.numel() % block_m == 0
    assert pair_of_row.numel() >= num_pairs + experts * (block_m - 1)
    real = pair_of_row[pair_of_row < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (pair_of_row[pair_of_row >= num_pairs] == num_pairs).all()  # padding is marked
    flat = ids.flatten()
    for block, expert in enumerate(expert_of_block.tolist()):
        rows = pair_of_row[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert == experts:
            assert rows.numel() == 0  # past the last run
        else:
            assert (flat[rows.long()] == expert).all()
    # Each expert's pairs sit in its own blocks, in expert order.
    used = [e for e in expert_of_block.tolist() if e < experts]
    assert used == sorted(used) and set(used) == set(flat.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 2), (37, 2), (20, 4), (9, 1)])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_the_reference(shape, tokens, top_k, dtype):
    hidden, inter, experts = shape
    if top_k > experts:
        pytest.skip("more experts per token than experts")
    x, w13, w2, weights, ids = problem(tokens, hidden, inter, experts, top_k, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    expected = experts_reference(x.float(), w13.float(), w2.float(), weights, ids).to(dtype)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_no_tokens_and_bad_arguments():
    x, w13, w2, weights, ids = problem(4, 64, 48, 4, 2, torch.float32)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 64)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13[:, :-2], w2, weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError):
        fused_moe(x, w13, w2, weights, ids.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first,count", [(0, 4), (4, 4), (2, 2), (7, 1)])
def test_a_range_of_the_experts_computes_only_their_choices(first, count, dtype):
    """Expert parallel: the kernel and the reference over experts [first, first + count) only (a
    rank's weights, global routing ids) give the full computation with every other choice's
    weight set to 0; the ranges of all ranks add up to the whole."""
    hidden, inter, experts, top_k = 64, 48, 8, 2
    x, w13, w2, weights, ids = problem(37, hidden, inter, experts, top_k, dtype)
    mine = (ids >= first) & (ids < first + count)
    restricted = experts_reference(x.float(), w13.float(), w2.float(), torch.where(mine, weights, 0.0), ids).to(dtype)
    local = slice(first, first + count)
    reference = experts_reference(x.float(), w13[local].float(), w2[local].float(), weights, ids, first).to(dtype)
    torch.testing.assert_close(reference, restricted, **TOLERANCES[dtype])
    out = fused_moe(x, w13[local].contiguous(), w2[local].contiguous(), weights, ids, first)
    torch.testing.assert_close(out, restricted, **TOLERANCES[dtype])
    if not mine.any(dim=1).all():
        untouched = ~mine.any(dim=1)  # tokens none of whose experts are here get exactly 0
        assert (out[untouched] == 0).all()


def test_the_ranks_ranges_add_up_to_all_the_experts():
    x, w13, w2, weights, ids = problem(20, 64, 48, 8, 2, torch.float32)
    parts = [
        fused_moe(x, w13[r * 4 : (r + 1) * 4].contiguous(), w2[r * 4 : (r + 1) * 4].contiguous(), weights, ids, r * 4)
        for r in range(2)
    ]
    torch.testing.assert_close(parts[0] + parts[1], fused_moe(x, w13, w2, weights, ids), **TOLERANCES[torch.float32])
