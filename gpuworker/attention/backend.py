"""Attention metadata shared by the model runner, the models and the attention backends.

The runner flattens a step's sequences into one ragged batch: decode sequences (one new token
each) come first, then prefill chunks. Every backend reads the same metadata, so the CPU
reference and the Triton kernels are interchangeable behind `AttentionBackend`.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds keys, 1 values). A token at position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block * block_size + offset``. The cache holds the model's dtype, or float8_e4m3fn with a static
scale per layer for keys (k_scale) and one for values (v_scale): gpuworker.kernels.quant.kv_cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeGuard

import torch

if TYPE_CHECKING:  # the metadata and protocols stay importable without Triton
    from gpuworker.kernels.norm.qk_norm import QKNorm


@dataclass
class AttentionMetadata:
    # [T] int64: cache slot of each new token; -1 marks padding (nothing written).
    slot_mapping: torch.Tensor
    # [B + 1] int32: cumulative query lengths; sequence i owns tokens [qsl[i], qsl[i+1]).
    query_start_loc: torch.Tensor
    # [B] int32: context length of each sequence after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [B, max_blocks] int32: block tables. Columns past a sequence's own blocks hold arbitrary valid
    # block ids (the model runner keeps rows across steps) and are never read.
    block_tables: torch.Tensor
    # The first `num_decode_seqs` sequences have exactly one query token each.
    num_decode_seqs: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so reference code and launchers need no device->host sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Where sliding-window layers keep their keys and values in a pool of their own (a model with
    # ModelConfig.layer_windows): that pool's slot_mapping and block_tables, the rest as here. A
    # sliding layer's table maps only the blocks its window can still read; the others are stale.
    windowed: AttentionMetadata | None = None
    # [T] int32 (None: every token causal): the last position each token attends to, at or past its
    # own. A token inside a span whose tokens attend to each other both ways (Gemma 3's images, which
    # a prefill chunk never cuts) sees to the span's end; every other token, to itself.
    span_ends: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs


class AttentionBackend(Protocol):
    """What the model calls once per layer and step.

    A backend whose class sets ``fuses_rotary_and_cache_write = True`` (see
    RotaryCacheWritingBackend) also does the rotary embedding: the model hands it unrotated queries
    and keys and the rotary cos/sin cache, and calls ``forward_with_rotary`` instead of ``forward``
    (the Triton backend rotates and writes the cache inside its attention launches). Without that
    attribute, the model rotates and calls ``forward``.
    """

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,  # an FP8 cache's scales (ignored by other caches)
        v_scale: float = 1.0,
        sliding_window: int | None = None,  # a query at p sees keys at p - window < position <= p
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's keys and values into the cache, then attend through the block tables."""
        ...


class RotaryCacheWritingBackend(AttentionBackend, Protocol):
    """A backend that takes rotary and the cache write off the model (fused into its kernels)."""

    fuses_rotary_and_cache_write: bool  # True

    def forward_with_rotary(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, num_heads, head_dim], not rotated
        key: torch.Tensor,  # [T, num_kv_heads, head_dim], not rotated
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        cos_cache: torch.Tensor,  # [max_positions, rot_dim // 2], float32 (RotaryEmbedding's)
        sin_cache: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        qk_norm: QKNorm | None = None,  # Qwen3's q_norm and k_norm, applied to each head before rotary
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Rotate query and key by positions (normalised first with a qk_norm), write the rotated keys
        and the values into the cache at meta.slot_mapping, attend through the block tables."""
        ...


def fuses_rotary_and_cache_write(backend: AttentionBackend) -> TypeGuard[RotaryCacheWritingBackend]:
    """Whether the model should hand rotary to the backend (forward_with_rotary)."""
    return bool(getattr(backend, "fuses_rotary_and_cache_write", False))
