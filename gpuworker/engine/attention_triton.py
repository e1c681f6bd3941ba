"""TritonAttentionBackend: the AttentionBackend of the GPU path, built from gpuworker.kernels.

Per layer and step: the model's rotary kernel has already rotated the queries and written this step's
keys and values into the cache (apply_rotary_and_cache, one launch), so forward_rotated only attends:
the paged decode kernel on the first meta.num_decode_seqs sequences (one query token each, one launch
whatever the context length) and the prefill kernel on the rest. Nothing here reads a device tensor
on the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from gpuworker.engine.attention import AttentionMetadata
from gpuworker.kernels.kv_cache_write import kv_cache_write
from gpuworker.kernels.paged_decode_attention import (MAX_SPLITS, MIN_PARTITION, SplitCounters,
                                                     multiprocessor_count, paged_decode_attention)
from gpuworker.kernels.prefill_attention import prefill_attention


class TritonAttentionBackend:
    name = "triton"
    # The model calls apply_rotary_and_cache, then forward_rotated (see gpuworker.engine.attention).
    fuses_rotary_and_cache_write = True

    def __init__(self) -> None:
        # Shared by every layer: decode launches run one after another on one stream.
        self._split_counters = SplitCounters()

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's keys and values into the cache, then attend (the unfused path)."""
        kv_cache_write(key, value, kv_cache, meta.slot_mapping)
        return self.forward_rotated(query, kv_cache, meta, scale)

    def forward_rotated(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], this step's K/V in it
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Attend through the block tables to a cache that already holds this step's keys and values.

        Rows that belong to no sequence (padding past query_start_loc[-1]) are zero, as in the
        torch reference. A decode sequence with seq_len 0 also gets zeros.
        """
        num_decode = meta.num_decode_seqs
        num_seqs = meta.num_seqs
        if not 0 <= num_decode <= num_seqs:
            raise ValueError(f"meta.num_decode_seqs {num_decode} must be in [0, num_seqs = {num_seqs}]")
        out = torch.empty_like(query)
        if num_decode > 0:
            counters = self._split_counters.get(num_decode * kv_cache.shape[-2], query.device)
            paged_decode_attention(
                query[:num_decode], kv_cache, meta.block_tables[:num_decode], meta.seq_lens[:num_decode],
                scale, meta.max_seq_len, out=out[:num_decode], counters=counters,
            )
        if num_seqs > num_decode:
            # query_start_loc values are absolute rows of `query`, so a slice addresses the prefill part.
            prefill_attention(
                query, kv_cache, meta.query_start_loc[num_decode:], meta.seq_lens[num_decode:],
                meta.block_tables[num_decode:], scale, meta.max_query_len, out=out,
            )
        rows_used = meta.query_start_loc_cpu[-1]
        if rows_used < out.shape[0]:
            out[rows_used:].zero_()
        return out

    @torch.inference_mode()
    def warm_up(self, kv_cache: torch.Tensor, num_q_heads: int, max_model_len: int, scale: float) -> None:
        """Compile every variant of the decode kernel a step can pick, before serving.

        The split count (chosen per launch from the batch and the longest context, up to MAX_SPLITS)
        sizes a constexpr tile, so each power of two is its own compiled kernel, once for a batch
        that fills the device and once for one that does not (each has its own tile and way of
        merging the partitions); an eager step meeting a new one would compile it (a second or more
        on a GPU) in the middle of serving.
        """
        block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        device = kv_cache.device
        most = min(MAX_SPLITS, -(-max_model_len // MIN_PARTITION))
        # One sequence, and the smallest batch whose programs fill the multiprocessors.
        for batch in (1, -(-multiprocessor_count(device) // num_kv_heads)):
            query = torch.zeros(batch, num_q_heads, head_dim, dtype=kv_cache.dtype, device=device)
            tables = torch.zeros(batch, -(-max_model_len // block_size), dtype=torch.int32, device=device)
            seq_lens = torch.ones(batch, dtype=torch.int32, device=device)
            counters = self._split_counters.get(batch * num_kv_heads, device)
            splits = 1
            while True:
                paged_decode_attention(query, kv_cache, tables, seq_lens, scale, max_model_len,
                                       counters=counters, num_splits=min(splits, most))
                if splits >= most:
                    break
                splits *= 2
