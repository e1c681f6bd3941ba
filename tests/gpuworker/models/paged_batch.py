"""Test helper: a paged KV cache with shuffled block tables and hand-built AttentionMetadata.

Plays the model runner's part in the model tests, so the model and the attention backend are
exercised through the same ragged, paged interface the engine uses.
"""

from __future__ import annotations

import random

import torch

from gpuworker.attention.backend import AttentionMetadata


class PagedBatcher:
    def __init__(
        self, mc, num_blocks: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> None:
        # mc: a ModelConfig, or anything with num_layers, num_kv_heads and head_dim.
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, mc.num_kv_heads, mc.head_dim, dtype=dtype)
            for _ in range(mc.num_layers)
        ]
        # Block 0 is left out so a table padded with 0 can never alias a real block of a sequence.
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def batch(
        self, chunks: list[tuple[str, list[int]]], pad_to: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """One forward's inputs for `chunks` [(seq_id, new token ids)], in the given order.

        `pad_to` appends padding tokens (slot -1, no sequence) up to that many tokens, as a runner
        padding to a captured batch shape would.
        """
        input_ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for seq_id, tokens in chunks:
            start = self.num_cached.get(seq_id, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, end)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(list(table))
            self.num_cached[seq_id] = end
        num_decode = 0
        for (_, tokens), seq_len in zip(chunks, seq_lens):
            if len(tokens) != 1 or seq_len == 1:
                break
            num_decode += 1
        for _ in range((pad_to or 0) - len(input_ids)):
            input_ids.append(0)
            positions.append(0)
            slots.append(-1)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            num_decode_seqs=num_decode,
            max_query_len=max(len(tokens) for _, tokens in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta
