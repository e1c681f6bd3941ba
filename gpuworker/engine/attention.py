"""Attention metadata shared by the model runner, the models and the attention backends.

The runner flattens a step's sequences into one ragged batch: decode sequences (one new token
each) come first, then prefill chunks. Every backend reads the same metadata, so the CPU
reference and the Triton kernels are interchangeable behind `AttentionBackend`.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds keys, 1 values). A token at position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeGuard

import torch


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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs


class AttentionBackend(Protocol):
    """What the model calls once per layer and step.

    A backend whose class sets ``fuses_rotary_and_cache_write = True`` (see
    RotaryCacheWritingBackend) gets its keys and values another way: the model rotates the queries
    and writes the rotated keys and the values into the cache itself, in one launch, and calls
    ``forward_rotated`` instead of ``forward``. Without that attribute, ``forward`` is called.
    """

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's keys and values into the cache, then attend through the block tables."""
        ...


class RotaryCacheWritingBackend(AttentionBackend, Protocol):
    """A backend that leaves rotary and the cache write to the model (one fused kernel before it)."""

    fuses_rotary_and_cache_write: bool  # True

    def forward_rotated(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim], already rotated
        kv_cache: torch.Tensor,  # already holding this step's keys and values at meta.slot_mapping
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Attend through the block tables; the cache is not written."""
        ...


def fuses_rotary_and_cache_write(backend: AttentionBackend) -> TypeGuard[RotaryCacheWritingBackend]:
    """Whether the model should call apply_rotary_and_cache and then backend.forward_rotated."""
    return bool(getattr(backend, "fuses_rotary_and_cache_write", False))
