"""TorchAttentionBackend against a dense per-token attention written independently of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpuworker.attention.torch_backend import TorchAttentionBackend
from tests.gpuworker.models.paged_batch import PagedBatcher


def dense_attention(q, k, v, scale):
    """q [Q, H, D] are the last Q positions of k/v [S, KVH, D]; one softmax per (token, head)."""
    num_q, num_heads, _ = q.shape
    context, num_kv_heads, _ = k.shape
    out = torch.empty_like(q)
    for i in range(num_q):
        visible = context - num_q + i + 1
        for h in range(num_heads):
            kv_head = h // (num_heads // num_kv_heads)
            weights = torch.softmax((k[:visible, kv_head] @ q[i, h]) * scale, dim=0)
            out[i, h] = weights @ v[:visible, kv_head]
    return out


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(4, 2, 16), (4, 4, 8), (6, 1, 4)])
def test_matches_dense_attention_over_steps(num_heads, num_kv_heads, block_size):
    head_dim, scale = 8, 8**-0.5
    shape = SimpleNamespace(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim)
    batcher = PagedBatcher(shape, num_blocks=128, block_size=block_size, seed=11)
    backend = TorchAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    # Several steps: fresh prefills, chunked prefill continuing, decodes first in later steps.
    steps = [
        [("a", 5), ("b", 1), ("c", 40)],
        [("a", 1), ("b", 1), ("c", 23), ("d", 9)],
        [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
    ]
    for step in steps:
        chunks = [(seq, [0] * n) for seq, n in step]
        _, _, meta = batcher.batch(chunks, pad_to=sum(n for _, n in step) + 3)
        total = meta.slot_mapping.shape[0]
        q = torch.randn(total, num_heads, head_dim, generator=gen)
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        out = backend.forward(q, k, v, batcher.kv_caches[0], meta, scale)
        start = 0
        for seq, n in step:
            old_k, old_v = history.get(seq, (k[:0], v[:0]))
            history[seq] = (torch.cat([old_k, k[start : start + n]]), torch.cat([old_v, v[start : start + n]]))
            expected = dense_attention(q[start : start + n], *history[seq], scale)
            torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)
            start += n
        assert torch.all(out[start:] == 0)  # padding rows


def test_writes_only_through_valid_slots():
    shape = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=4)
    batcher = PagedBatcher(shape, num_blocks=8, block_size=4, seed=2)
    _, _, meta = batcher.batch([("a", [0] * 6)], pad_to=9)
    cache = batcher.kv_caches[0]
    k = torch.randn(9, 2, 4)
    v = torch.randn(9, 2, 4)
    TorchAttentionBackend().forward(torch.randn(9, 2, 4), k, v, cache, meta, 0.5)
    flat_k, flat_v = cache[0].reshape(-1, 2, 4), cache[1].reshape(-1, 2, 4)
    slots = meta.slot_mapping[:6]
    assert torch.equal(flat_k[slots], k[:6]) and torch.equal(flat_v[slots], v[:6])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots] = True
    # Nothing else was touched: the three padding tokens (slot -1) wrote nowhere.
    assert torch.all(flat_k[~written] == 0) and torch.all(flat_v[~written] == 0)


def test_rejects_heads_not_divisible_by_kv_heads():
    shape = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=4)
    batcher = PagedBatcher(shape, num_blocks=4, block_size=4)
    _, _, meta = batcher.batch([("a", [0])])
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        TorchAttentionBackend().forward(
            torch.randn(1, 3, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 4), batcher.kv_caches[0], meta, 0.5
        )
