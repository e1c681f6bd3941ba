"""Pure-torch paged attention: the reference every faster backend is checked against.

Clear over fast: new keys/values are scattered into the cache through slot_mapping, then each
sequence gathers its whole context through its block table and attends with an explicit causal
mask, in float32 (an FP8 cache's keys and values are dequantized to float32 first). One Python
iteration per sequence, vectorised within it; the host copies of the metadata mean no device->host
sync is needed to slice the batch.
"""

from __future__ import annotations

import torch

from gpuworker.attention.backend import AttentionMetadata
from gpuworker.kernels.quant.kv_cache import dequantize_kv, quantize_kv


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D], kv_cache [2, blocks, block_size, KVH, D] -> [T, H, D].

        sliding_window: each query sees only the keys of its last `sliding_window` positions, and only
        those are gathered (the blocks before them may have left the sequence's table)."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        key_cache = kv_cache[0].view(num_blocks * block_size, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(num_blocks * block_size, num_kv_heads, head_dim)
        write_cache(key, value, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)

        # Rows past the last sequence (padding for a fixed batch shape) stay zero.
        output = torch.zeros_like(query)
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        offsets = torch.arange(block_size, device=query.device)
        for i, seq_len in enumerate(seq_lens):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            # The first position any of this chunk's queries can see.
            first = 0 if sliding_window is None else max(0, seq_len - (end - start) - sliding_window + 1)
            first_block = first // block_size
            blocks = meta.block_tables[i, first_block : (seq_len + block_size - 1) // block_size].long()
            slots = (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)
            slots = slots[first - first_block * block_size : seq_len - first_block * block_size]
            output[start:end] = attend(
                query[start:end],
                dequantize_kv(key_cache[slots], k_scale),
                dequantize_kv(value_cache[slots], v_scale),
                scale,
                sliding_window,
                None if meta.span_ends is None else meta.span_ends[start:end] - first,  # as keys count them
            )
        return output


def write_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each token's K/V at its slot; slots < 0 (padding) are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache[slots] = quantize_kv(key[valid], key_cache.dtype, k_scale)
    value_cache[slots] = quantize_kv(value[valid], value_cache.dtype, v_scale)


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    span_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a query chunk over its sequence's whole context.

    query [Q, H, D] holds the last Q positions of a context of S = len(keys) tokens, so query row i
    sits at position S - Q + i and sees keys 0..S - Q + i (with sliding_window W, only those past
    S - Q + i - W). keys/values [S, KVH, D]. span_ends [Q]: the last position each row sees (at or
    past its own: AttentionMetadata.span_ends), where some rows see past themselves.
    """
    num_queries, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group.
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    query_pos = torch.arange(context_len - num_queries, context_len, device=query.device)
    key_pos = torch.arange(context_len, device=query.device)
    query_end = query_pos if span_ends is None else span_ends
    hidden = key_pos[None, None, :] > query_end[None, :, None]
    if sliding_window is not None:
        hidden = hidden | (key_pos[None, None, :] <= query_pos[None, :, None] - sliding_window)
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
