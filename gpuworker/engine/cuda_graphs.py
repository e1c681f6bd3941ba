"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed with new inputs.

A decode-only step has static shapes once its batch is padded to a bucket, so its hundreds of
kernel launches collapse into one graph replay. Padding rows get slot -1 (nothing written) and
seq_len 0 (the decode kernel returns zeros), so they never touch real KV blocks. The decode
kernel's split count depends only on the host-side max_seq_len, fixed at max_model_len for capture.
"""

from __future__ import annotations

import torch
from torch import nn

from gpuworker.engine.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 576, 640, 704, 768,
           832, 896, 960, 1024)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], *, max_num_seqs: int,
                 max_model_len: int, block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = bucket_sizes(max_num_seqs)
        n = self.buckets[-1]
        device = kv_caches[0].device
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            num_decode_seqs=size, max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[0] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up compiles the Triton kernels outside capture
            for size in self.buckets:
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for size in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return (meta.num_decode_seqs == meta.num_seqs == num_tokens
                and num_tokens <= self.buckets[-1] and meta.max_seq_len <= self.max_model_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:size].zero_()
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:n]
