"""TritonAttentionBackend: the AttentionBackend of the GPU path, built from gpuworker.kernels.

Per layer and step the model hands over unrotated queries and keys (forward_with_rotary): the paged
decode kernel rotates each decode sequence's query and key itself, stores the key and value in the
cache and attends (one launch whatever the context length); prefill chunks go through the rotary
kernel, which writes their keys and values into the cache, then the prefill kernel. Nothing here
reads a device tensor on the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from gpuworker.attention.backend import AttentionMetadata
from gpuworker.kernels.attention.kv_cache_write import kv_cache_write
from gpuworker.kernels.attention.paged_decode import (
    MAX_SPLITS,
    MIN_PARTITION,
    NewTokens,
    SplitCounters,
    multiprocessor_count,
    paged_decode_attention,
)
from gpuworker.kernels.attention.prefill import prefill_attention
from gpuworker.kernels.attention.rotary import apply_rotary_and_cache
from gpuworker.kernels.norm.qk_norm import QKNorm


class TritonAttentionBackend:
    name = "triton"
    # The model calls forward_with_rotary (see gpuworker.attention.backend).
    fuses_rotary_and_cache_write = True

    def __init__(self) -> None:
        # Shared by every layer: decode launches run one after another on one stream.
        self._split_counters = SplitCounters()

    # The two entry points take what backend.py's protocols say (shapes are given there).

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
        """Write this step's keys and values into the cache, then attend (the unfused path)."""
        kv_cache_write(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        return self.forward_rotated(query, kv_cache, meta, scale, k_scale, v_scale, sliding_window)

    def forward_with_rotary(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        qk_norm: QKNorm | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Rotary, the cache write and attention. Decode rows take one launch each layer (the decode
        kernel rotates and caches their token itself); the prefill rows after them (and padding) go
        through the rotary kernel, which rotates their queries in place and writes their keys and
        values, before the prefill kernel attends. key and value are left as they were. qk_norm
        (Qwen3): both launches normalise the heads before rotating them."""
        num_decode = self._check(meta)
        if num_decode < query.shape[0]:
            rest = slice(num_decode, None)
            apply_rotary_and_cache(
                positions[rest],
                query[rest],
                key[rest],
                value[rest],
                cos_cache,
                sin_cache,
                kv_cache,
                meta.slot_mapping[rest],
                k_scale,
                v_scale,
                qk_norm,
            )
        new_tokens = None
        if num_decode > 0:
            new_tokens = NewTokens(
                positions[:num_decode],
                key[:num_decode],
                value[:num_decode],
                cos_cache,
                sin_cache,
                meta.slot_mapping[:num_decode],
                qk_norm,
            )
        return self._attend(query, kv_cache, meta, scale, k_scale, v_scale, new_tokens, sliding_window)

    def forward_rotated(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], this step's K/V in it
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Attend through the block tables to a cache that already holds this step's keys and values.

        Rows that belong to no sequence (padding past query_start_loc[-1]) are zero, as in the
        torch reference. A decode sequence with seq_len 0 also gets zeros.
        """
        self._check(meta)
        return self._attend(query, kv_cache, meta, scale, k_scale, v_scale, sliding_window=sliding_window)

    @staticmethod
    def _check(meta: AttentionMetadata) -> int:
        num_decode = meta.num_decode_seqs
        if not 0 <= num_decode <= meta.num_seqs:
            raise ValueError(f"meta.num_decode_seqs {num_decode} must be in [0, num_seqs = {meta.num_seqs}]")
        return num_decode

    def _attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float,
        v_scale: float,
        new_tokens: NewTokens | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """The decode kernel on the first num_decode_seqs rows (given their new_tokens, it rotates and
        caches them itself), the prefill kernel on the rest, zeros on padding rows. sliding_window:
        both kernels read only each query's window."""
        num_decode, num_seqs = meta.num_decode_seqs, meta.num_seqs
        out = torch.empty_like(query)
        if num_decode > 0:
            counters = self._split_counters.get(num_decode * kv_cache.shape[-2], query.device)
            paged_decode_attention(
                query[:num_decode],
                kv_cache,
                meta.block_tables[:num_decode],
                meta.seq_lens[:num_decode],
                scale,
                meta.max_seq_len,
                out=out[:num_decode],
                counters=counters,
                new_tokens=new_tokens,
                k_scale=k_scale,
                v_scale=v_scale,
                window=sliding_window or 0,
            )
        if num_seqs > num_decode:
            # query_start_loc values are absolute rows of `query`, so a slice addresses the prefill part.
            prefill_attention(
                query,
                kv_cache,
                meta.query_start_loc[num_decode:],
                meta.seq_lens[num_decode:],
                meta.block_tables[num_decode:],
                scale,
                meta.max_query_len,
                out=out,
                k_scale=k_scale,
                v_scale=v_scale,
                window=sliding_window or 0,
                span_ends=meta.span_ends,
            )
        rows_used = meta.query_start_loc_cpu[-1]
        if rows_used < out.shape[0]:
            out[rows_used:].zero_()
        return out

    @torch.inference_mode()
    def warm_up(
        self,
        kv_cache: torch.Tensor,
        num_q_heads: int,
        max_model_len: int,
        scale: float,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        dtype: torch.dtype,
        qk_norm: QKNorm | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """Compile every variant of the decode kernel a step can pick, before serving.

        The split count (chosen per launch from the batch and the longest context, up to MAX_SPLITS)
        sizes a constexpr tile, so each power of two is its own compiled kernel, once for a batch
        that fills the device and once for one that does not (each has its own tile and way of
        merging the partitions); an eager step meeting a new one would compile it (a second or more
        on a GPU) in the middle of serving. The launches are the model's (forward_with_rotary: views
        of a fused qkv of `dtype`, the model's, this rotary cache) with slot -1, so nothing is written
        to the cache. qk_norm: the model's (Qwen3), whose launches are a variant of their own;
        sliding_window: a sliding layer's window (its launches are variants of their own too).
        """
        block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        device = kv_cache.device
        q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        most = min(MAX_SPLITS, -(-max_model_len // MIN_PARTITION))
        # One sequence, and the smallest batch whose programs fill the multiprocessors.
        for batch in (1, -(-multiprocessor_count(device) // num_kv_heads)):
            qkv = torch.zeros(batch, q_size + 2 * kv_size, dtype=dtype, device=device)
            query = qkv[:, :q_size].view(batch, num_q_heads, head_dim)
            new_tokens = NewTokens(
                torch.zeros(batch, dtype=torch.int64, device=device),
                qkv[:, q_size : q_size + kv_size].view(batch, num_kv_heads, head_dim),
                qkv[:, q_size + kv_size :].view(batch, num_kv_heads, head_dim),
                cos_cache,
                sin_cache,
                torch.full((batch,), -1, dtype=torch.int64, device=device),
                qk_norm,
            )
            tables = torch.zeros(batch, -(-max_model_len // block_size), dtype=torch.int32, device=device)
            seq_lens = torch.ones(batch, dtype=torch.int32, device=device)
            counters = self._split_counters.get(batch * num_kv_heads, device)
            splits = 1
            while True:
                paged_decode_attention(
                    query,
                    kv_cache,
                    tables,
                    seq_lens,
                    scale,
                    max_model_len,
                    counters=counters,
                    num_splits=min(splits, most),
                    new_tokens=new_tokens,
                    window=sliding_window or 0,
                )
                if splits >= most:
                    break
                splits *= 2
