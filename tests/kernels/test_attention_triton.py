"""TritonAttentionBackend against TorchAttentionBackend over steps mixing prefill chunks, decodes and padding."""

from __future__ import annotations

import pytest
import torch

from gpuworker.engine.attention import AttentionMetadata
from gpuworker.engine.attention_torch import TorchAttentionBackend
from gpuworker.engine.attention_triton import TritonAttentionBackend

ON_CUDA = torch.cuda.is_available()
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = (32, 8, 128) if ON_CUDA else (4, 2, 32)
BLOCK_SIZE = 16


class _Sequences:
    """Hands out blocks to sequences and builds the metadata of one step, as the model runner does."""

    def __init__(self, num_blocks: int, device: str) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 stays unused
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self.device = device

    def step(self, chunks: list[tuple[str, int]], padding: int = 0) -> AttentionMetadata:
        slots, qsl, seq_lens, tables = [], [0], [], []
        for name, num_new in chunks:
            start = self.lengths.get(name, 0)
            table = self.tables.setdefault(name, [])
            while len(table) * BLOCK_SIZE < start + num_new:
                table.append(self.free.pop())
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + num_new)]
            self.lengths[name] = start + num_new
            qsl.append(qsl[-1] + num_new)
            seq_lens.append(start + num_new)
            tables.append(table)
        slots += [-1] * padding
        num_decode = 0
        while num_decode < len(chunks) and chunks[num_decode][1] == 1 and seq_lens[num_decode] > 1:
            num_decode += 1
        width = max(len(t) for t in tables)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        return AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(qsl, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            num_decode_seqs=num_decode,
            max_query_len=max(n for _, n in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )


SMALL_STEPS = [
    ([("a", 40), ("b", 5), ("c", 1)], 0),  # fresh prompts; b is chunked
    ([("a", 1), ("c", 1), ("b", 2), ("d", 9)], 3),  # decodes first, then prefill, then padding rows
    ([("a", 1), ("b", 1), ("c", 1), ("d", 1)], 2),  # pure decode, padded as for a CUDA graph
]
REAL_STEPS = [
    ([("a", 1500), ("b", 512), ("c", 1)], 0),
    ([("a", 1), ("c", 1), ("b", 512), ("d", 300)], 5),
    ([("a", 1), ("b", 1), ("c", 1), ("d", 1)], 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_backend_step_by_step(dtype, device, generator, tolerance):
    steps = REAL_STEPS if ON_CUDA else SMALL_STEPS
    num_blocks = 300 if ON_CUDA else 16
    sequences = _Sequences(num_blocks, device)
    triton_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    triton_cache = triton_cache.to(dtype).to(device)
    torch_cache = triton_cache.clone()
    scale = HEAD_DIM**-0.5
    for chunks, padding in steps:
        meta = sequences.step(chunks, padding)
        num_tokens = meta.query_start_loc_cpu[-1] + padding
        query = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
        value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)

        got = TritonAttentionBackend().forward(query, key, value, triton_cache, meta, scale)
        expected = TorchAttentionBackend().forward(query, key, value, torch_cache, meta, scale)

        torch.testing.assert_close(triton_cache, torch_cache, atol=0, rtol=0)
        torch.testing.assert_close(got, expected, **tolerance(dtype))
        if padding:
            assert torch.equal(got[-padding:], torch.zeros_like(got[-padding:]))
