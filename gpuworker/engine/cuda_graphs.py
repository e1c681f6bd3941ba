"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed with new inputs.

A decode-only step has static shapes once its batch is padded to a bucket, so its hundreds of
kernel launches collapse into one graph replay. Padding rows get slot -1 (nothing written) and
seq_len 0 (the decode kernel returns zeros), so they never touch real KV blocks. The decode
kernel's split count depends only on the host-side max_seq_len, fixed at max_model_len for capture.

The graphs' inputs live in one device buffer that a step fills from one host staging buffer
(`GraphInputs`): one copy of the per-row inputs and one of the block tables' used columns, then one
launch. A decode's input token is often still on
the device (sampled by the step in flight, see model_runner): the buffer starts with `sampled`,
where every step's sampled ids are kept, followed by the host's known ids; the graph's first
kernel gathers each row's token from either part through a per-row index.

Capture can be left to later (`defer=True`, what a replica does): nothing is captured at
construction, and each `capture_next` call captures one graph, which the engine makes between
steps once it is ready: the largest first, so that every batch size can pad up to it, then batch 1,
then the rest. Capturing all buckets took 1-2 s of a replica's start on the H200.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from gpuworker.attention.backend import AttentionMetadata

BUCKETS = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    160,
    192,
    224,
    256,
    320,
    384,
    448,
    512,
    576,
    640,
    704,
    768,
    832,
    896,
    960,
    1024,
)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


def padded_sizes(captured: Collection[int], max_rows: int) -> tuple[int | None, ...]:
    """Index n (0..max_rows) -> the captured graph a decode of n rows pads up to: the smallest captured
    size >= n (padding is cheap: decode reads weights), None where there is none (the step runs eager).
    Rebuilt as each graph is captured, so that a step looks its size up instead of scanning."""
    table: list[int | None] = [None] * (max_rows + 1)
    smallest = None
    for n in range(max_rows, -1, -1):
        if n in captured:
            smallest = n
        table[n] = smallest
    return tuple(table)


def _align(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


class GraphInputs:
    """The decode graphs' inputs for up to `rows` sequences of up to `max_blocks` blocks, in one buffer.

    Layout (each part 16-byte aligned): sampled ids int64 [rows] (written on the device), known ids
    int64 [rows], token index int64 [rows] (into sampled + known ids), positions int64 [rows], slots
    int64 [rows], seq_lens int32 [rows], block tables int32 [rows, max_blocks]. Everything from the
    known ids on comes from the host: a step uploads the parts before the tables in one copy, and of
    the tables only its rows' first `width` columns (the step's widest sequence, see
    block_tables.padded_width), not max_model_len's blocks. The columns past them keep what earlier
    steps left: the attention kernels read a row only below its seq_len.

    `windowed` (a window pool, engine.window_blocks): the sliding layers' slots int64 [rows] follow
    the slots, and each block-table row holds the sequence's window table after its block table
    (both uploaded in the one copy of the tables).
    """

    def __init__(self, rows: int, max_blocks: int, device: torch.device, windowed: bool = False) -> None:
        rows += rows % 2  # an even count keeps the known ids right after the sampled ones, aligned
        self.rows, self.max_blocks = rows, max_blocks
        self.windowed = windowed
        self.row_blocks = 2 * max_blocks if windowed else max_blocks  # a block-table row's entries
        self._offsets: dict[str, int] = {}
        total = 0
        for name, nbytes in (
            ("sampled", 8 * rows),
            ("known_ids", 8 * rows),
            ("token_index", 8 * rows),
            ("positions", 8 * rows),
            ("slot_mapping", 8 * rows),
            ("window_slot_mapping", 8 * rows if windowed else 0),
            ("seq_lens", 4 * rows),
            ("block_tables", 4 * rows * self.row_blocks),
        ):
            self._offsets[name] = total
            total += _align(nbytes)
        self.upload_start = self._offsets["known_ids"]
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=device)
        self.sampled = self._part(self.buffer, "sampled", rows, torch.int64)
        # sampled then the known ids, without a gap: what token_index points into
        self.ids = self._part(self.buffer, "sampled", 2 * rows, torch.int64)
        self.token_index = self._part(self.buffer, "token_index", rows, torch.int64)
        self.positions = self._part(self.buffer, "positions", rows, torch.int64)
        self.slot_mapping = self._part(self.buffer, "slot_mapping", rows, torch.int64)
        self.seq_lens = self._part(self.buffer, "seq_lens", rows, torch.int32)
        tables = self._part(self.buffer, "block_tables", rows * self.row_blocks, torch.int32).view(rows, -1)
        # [rows, tables per row, max_blocks]: a step's columns of every table of its rows in one view
        self._tables = tables.view(rows, self.row_blocks // max_blocks, max_blocks)
        self.block_tables = tables[:, :max_blocks]
        self.window_slot_mapping = self.window_block_tables = None
        if windowed:
            self.window_slot_mapping = self._part(self.buffer, "window_slot_mapping", rows, torch.int64)
            self.window_block_tables = tables[:, max_blocks:]
            self.window_slot_mapping.fill_(-1)
        self.slot_mapping.fill_(-1)  # capture's warm-up runs write no KV

    def _part(self, buffer, name: str, count: int, dtype, base: int = 0):
        """A typed view of `count` elements of part `name` of a buffer laid out from byte `base` on."""
        start = self._offsets[name] - base
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else np.dtype(dtype).itemsize
        return buffer[start : start + count * itemsize].view(dtype)

    def upload(
        self,
        *,
        size: int,
        known_ids: np.ndarray,
        placeholders: np.ndarray,
        sampled_rows: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        window_slot_mapping: np.ndarray | None = None,
        window_block_tables: np.ndarray | None = None,
    ) -> None:
        """Fill the inputs of n = len(known_ids) decodes padded to `size` rows.

        The rows at `placeholders` take their token from `sampled` at `sampled_rows`, the others from
        known_ids; block_tables [n, width], of which only these columns are copied. Padding rows get
        slot -1 and seq_len 0. With `windowed`, the window pool's slots and tables too (as
        slot_mapping and block_tables).
        """
        n, width = len(known_ids), block_tables.shape[1]
        base, rows = self.upload_start, self.rows
        end = self._offsets["block_tables"]
        per_row = self._tables.shape[1]
        host = torch.empty(end - base + 4 * n * per_row * width, dtype=torch.uint8, pin_memory=self.buffer.is_cuda)
        array = host.numpy()

        def part(name: str, count: int, dtype) -> np.ndarray:
            return self._part(array, name, count, dtype, base)

        # Padding rows read a known id of 0 (any valid token): they must not index past the vocabulary.
        part("known_ids", size, np.int64)[:] = np.pad(known_ids, (0, size - n))
        index = part("token_index", size, np.int64)
        index[:] = rows + np.arange(size)  # row i's known id
        index[placeholders] = sampled_rows
        part("positions", size, np.int64)[:] = np.pad(positions, (0, size - n))
        part("slot_mapping", size, np.int64)[:] = np.pad(slot_mapping, (0, size - n), constant_values=-1)
        part("seq_lens", size, np.int32)[:] = np.pad(seq_lens, (0, size - n))
        host_tables = host[end - base :].view(torch.int32).view(n, per_row, width)
        tables = host_tables.numpy()
        tables[:, 0] = block_tables
        if self.windowed:
            windows = part("window_slot_mapping", size, np.int64)
            windows[:] = np.pad(window_slot_mapping, (0, size - n), constant_values=-1)
            tables[:, 1] = window_block_tables
        self.buffer[base:end].copy_(host[: end - base], non_blocking=True)
        # Strided on the device unless the step fills whole rows; either way n * width entries cross.
        self._tables[:n, :, :width].copy_(host_tables, non_blocking=True)


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        defer: bool = False,
        windowed: bool = False,
    ) -> None:
        """windowed: the model's sliding layers keep a window pool (meta.windowed)."""
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = bucket_sizes(max_num_seqs)
        n = self.buckets[-1]
        device = kv_caches[0].device
        self.inputs = GraphInputs(n, -(-max_model_len // block_size), device, windowed)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._padded_sizes = padded_sizes(self.graphs, n)
        self._pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then reuse its pool, and (deferred) every size can pad up.
        self.pending = sorted(self.buckets, reverse=True)
        if defer:
            self.pending.insert(1, self.pending.pop())  # then batch 1, the most common
        while self.pending and not defer:
            self.capture_next()

    @property
    def sampled(self) -> torch.Tensor:
        """[max bucket] int64: where a step's sampled ids go (see model_runner), read by the next replay."""
        return self.inputs.sampled

    def _meta(self, size: int) -> AttentionMetadata:
        inputs = self.inputs
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=inputs.seq_lens[:size],
            block_tables=inputs.block_tables[:size],
            num_decode_seqs=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[0] * size,
        )
        if inputs.windowed:
            meta.windowed = replace(
                meta, slot_mapping=inputs.window_slot_mapping[:size], block_tables=inputs.window_block_tables[:size]
            )
        return meta

    def _forward(self, size: int) -> torch.Tensor:
        input_ids = self.input_ids[:size]
        torch.index_select(self.inputs.ids, 0, self.inputs.token_index[:size], out=input_ids)
        return self.model(input_ids, self.inputs.positions[:size], self.kv_caches, self._meta(size))

    @torch.inference_mode()
    def capture_next(self) -> bool:
        """Capture the next pending bucket's graph; return whether any remain.

        Safe between steps, with a step still in flight: everything below is ordered after it on
        the device, and the warm-up forward writes no KV (slot -1) and reads none (seq_len 0),
        whatever the last step left in the inputs. The next step's upload rewrites both."""
        size = self.pending.pop(0)
        self.inputs.slot_mapping.fill_(-1)
        if self.inputs.windowed:
            self.inputs.window_slot_mapping.fill_(-1)
        self.inputs.seq_lens.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up compiles the Triton kernels outside capture
            self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's calls matter to the capture (the server's threads go on).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.outputs[size] = self._forward(size)
        self.graphs[size] = graph
        self._padded_sizes = padded_sizes(self.graphs, self.buckets[-1])
        return bool(self.pending)

    def _graph_size(self, n: int) -> int | None:
        """The captured graph n rows pad up to (see padded_sizes); None: none holds them."""
        return self._padded_sizes[n] if n < len(self._padded_sizes) else None

    def can_run(self, num_decode_seqs: int, num_seqs: int, num_tokens: int, max_seq_len: int) -> bool:
        return (
            num_decode_seqs == num_seqs == num_tokens
            and max_seq_len <= self.max_model_len
            and self._graph_size(num_tokens) is not None
        )

    def run(
        self,
        *,
        known_ids: np.ndarray,
        placeholders: np.ndarray,
        sampled_rows: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        window_slot_mapping: np.ndarray | None = None,
        window_block_tables: np.ndarray | None = None,
    ) -> torch.Tensor:
        """One decode step from host arrays (see GraphInputs.upload): hidden states [n, hidden_size]."""
        n = len(known_ids)
        size = self._graph_size(n)
        self.inputs.upload(
            size=size,
            known_ids=known_ids,
            placeholders=placeholders,
            sampled_rows=sampled_rows,
            positions=positions,
            slot_mapping=slot_mapping,
            seq_lens=seq_lens,
            block_tables=block_tables,
            window_slot_mapping=window_slot_mapping,
            window_block_tables=window_block_tables,
        )
        self.graphs[size].replay()
        return self.outputs[size][:n]
