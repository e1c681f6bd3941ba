"""The running sequences' block tables as rows of one numpy array, kept across steps.

The block manager grows each sequence's table (a list) by appending; rebuilding a padded
[num_seqs, max_blocks] table from those lists every step costs more host time than the rest of the
step's input preparation at large batches. Here each sequence keeps a row, and a step writes only
the blocks its sequences gained since the last one. A table the block manager replaced (a sequence
freed by preemption and admitted again gets a new list) is written again from the start. The
sliding layers' window tables (engine.window_blocks) get a BlockTables of their own (`window=True`):
their dropped entries are never read, so they need not be written.

A step's table is as wide as its widest sequence needs (padded_width), never max_model_len's
blocks: at 1M tokens those are 64Ki columns a row, megabytes a step for a few blocks of use. The
array itself widens only as sequences grow. Columns past a sequence's own blocks hold zeros or an
earlier sequence's block ids; the attention kernels read a sequence's table only below its seq_len.
"""

from __future__ import annotations

import numpy as np

from gpuworker.engine.sequence import Sequence, SequenceStatus

MIN_WIDTH = 16  # columns: short contexts all share one table shape


def padded_width(num_blocks: int, max_blocks: int) -> int:
    """The columns of a table for sequences of up to num_blocks blocks: the next power of two (so a
    run sees few shapes and the array widens a logarithmic number of times), at least MIN_WIDTH and
    at most max_blocks (the blocks of max_model_len, which the decode graphs' tables hold), unless
    num_blocks itself is more."""
    return max(num_blocks, min(1 << (max(num_blocks, MIN_WIDTH) - 1).bit_length(), max_blocks))


class _Row:
    """A sequence's row, and which of its block table (the list object) is written there so far."""

    __slots__ = ("index", "table", "written", "seq")

    def __init__(self, index: int, table: list[int], seq: Sequence) -> None:
        self.index = index
        self.table = table
        self.written = 0
        self.seq = seq


class BlockTables:
    def __init__(self, capacity: int, max_blocks: int, window: bool = False) -> None:
        self.window = window  # rows of the sequences' window_block_table, not their block_table
        self.max_blocks = max_blocks
        self.array = np.zeros((capacity, padded_width(1, max_blocks)), dtype=np.int32)
        self._rows: dict[int, _Row] = {}  # by seq_id
        self._free_rows = list(range(capacity - 1, -1, -1))

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """The row of each sequence (int64 [len(seqs)]), its new blocks written first."""
        out = np.empty(len(seqs), dtype=np.int64)
        rows = self._rows
        array = self.array
        for i, seq in enumerate(seqs):
            table = seq.window_block_table if self.window else seq.block_table
            row = rows.get(seq.seq_id)
            if row is None:
                row = rows[seq.seq_id] = _Row(self._take_row(seqs), table, seq)
                array = self.array  # taking a row may have grown it
            elif row.table is not table:
                row.table, row.written = table, 0
            if len(table) > row.written:
                if len(table) > array.shape[1]:
                    array = self._widen(len(table))
                array[row.index, row.written : len(table)] = table[row.written :]
                row.written = len(table)
            out[i] = row.index
        return out

    def gather(self, rows: np.ndarray, num_blocks: int) -> np.ndarray:
        """A step's table: the `rows` (of rows()) over padded_width(num_blocks) columns, where
        num_blocks covers the step's longest seq_len."""
        width = padded_width(num_blocks, self.max_blocks)
        if width > self.array.shape[1]:
            self._widen(width)
        return self.array[rows, :width]

    def _take_row(self, batch: list[Sequence]) -> int:
        if not self._free_rows:
            # Rows of sequences that no longer run go back; those of this batch stay.
            in_batch = {seq.seq_id for seq in batch}
            for seq_id, row in list(self._rows.items()):
                if row.seq.status is not SequenceStatus.RUNNING and seq_id not in in_batch:
                    del self._rows[seq_id]
                    self._free_rows.append(row.index)
            if not self._free_rows:
                self._grow()
        return self._free_rows.pop()

    def _grow(self) -> None:
        capacity = self.array.shape[0]
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self._free_rows.extend(range(2 * capacity - 1, capacity - 1, -1))

    def _widen(self, width: int) -> np.ndarray:
        width = padded_width(width, self.max_blocks)
        extra = np.zeros((self.array.shape[0], width - self.array.shape[1]), dtype=np.int32)
        self.array = np.concatenate([self.array, extra], axis=1)
        return self.array
