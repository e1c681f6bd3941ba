"""The running sequences' block tables as rows of one numpy array, kept across steps.

The block manager grows each sequence's table (a list) by appending; rebuilding a padded
[num_seqs, max_blocks] table from those lists every step costs more host time than the rest of the
step's input preparation at large batches. Here each sequence keeps a row, and a step writes only
the blocks its sequences gained since the last one. A table the block manager replaced (a sequence
freed by preemption and admitted again gets a new list) is written again from the start.
"""

from __future__ import annotations

import numpy as np

from gpuworker.engine.sequence import Sequence, SequenceStatus


class BlockTables:
    def __init__(self, capacity: int, max_blocks: int) -> None:
        self.array = np.zeros((capacity, max_blocks), dtype=np.int32)
        # seq_id -> [row, the table list written, how many of its blocks are written, the sequence]
        self._records: dict[int, list] = {}
        self._free_rows = list(range(capacity - 1, -1, -1))

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """The row of each sequence (int64 [len(seqs)]), its new blocks written first."""
        out = np.empty(len(seqs), dtype=np.int64)
        records = self._records
        array = self.array
        for i, seq in enumerate(seqs):
            table = seq.block_table
            record = records.get(seq.seq_id)
            if record is None:
                record = records[seq.seq_id] = [self._take_row(seqs), table, 0, seq]
                array = self.array  # taking a row may have grown it
            elif record[1] is not table:
                record[1], record[2] = table, 0
            written = record[2]
            if len(table) > written:
                if len(table) > array.shape[1]:
                    array = self._widen(len(table))
                array[record[0], written:len(table)] = table[written:]
                record[2] = len(table)
            out[i] = record[0]
        return out

    def _take_row(self, batch: list[Sequence]) -> int:
        if not self._free_rows:
            # Rows of sequences that no longer run go back; those of this batch stay.
            in_batch = {seq.seq_id for seq in batch}
            for seq_id, record in list(self._records.items()):
                if record[3].status is not SequenceStatus.RUNNING and seq_id not in in_batch:
                    del self._records[seq_id]
                    self._free_rows.append(record[0])
            if not self._free_rows:
                self._grow()
        return self._free_rows.pop()

    def _grow(self) -> None:
        capacity = self.array.shape[0]
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self._free_rows.extend(range(2 * capacity - 1, capacity - 1, -1))

    def _widen(self, width: int) -> np.ndarray:
        extra = np.zeros((self.array.shape[0], width - self.array.shape[1]), dtype=np.int32)
        self.array = np.concatenate([self.array, extra], axis=1)
        return self.array
