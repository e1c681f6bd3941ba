"""BlockTables: persistent rows that follow the block manager's tables across steps."""

from __future__ import annotations

from gpuworker.engine.block_tables import MIN_WIDTH, BlockTables, padded_width
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.sequence import SequenceGroup, SequenceStatus


def _seqs(count: int):
    seqs = []
    for i in range(count):
        group = SequenceGroup(f"r{i}", [1, 2, 3], SamplingParams(), i, 8, first_seq_id=i)
        seq = group.seqs[0]
        seq.status = SequenceStatus.RUNNING
        seqs.append(seq)
    return seqs


def _table(tables: BlockTables, row: int, width: int) -> list[int]:
    return tables.array[row, :width].tolist()


def test_rows_follow_appended_and_replaced_tables():
    tables = BlockTables(capacity=4, max_blocks=3)
    a, b = _seqs(2)
    a.block_table, b.block_table = [7], [3, 4]
    rows = tables.rows([a, b]).tolist()
    assert _table(tables, rows[0], 1) == [7] and _table(tables, rows[1], 2) == [3, 4]
    a.block_table.append(9)  # grown in place, as BlockManager.allocate does
    assert tables.rows([a]).tolist() == rows[:1]
    assert _table(tables, rows[0], 2) == [7, 9]
    a.block_table = [5]  # freed and admitted again: a new list, written from the start
    tables.rows([a])
    assert _table(tables, rows[0], 1) == [5]
    a.block_table += [6, 8, 11]  # longer than max_blocks: the array widens
    tables.rows([a])
    assert _table(tables, rows[0], 4) == [5, 6, 8, 11]
    assert _table(tables, rows[1], 2) == [3, 4]


def test_rows_of_finished_sequences_are_reused_and_running_ones_kept():
    tables = BlockTables(capacity=2, max_blocks=2)
    a, b, c, d = _seqs(4)
    for i, seq in enumerate((a, b, c, d)):
        seq.block_table = [10 + i]
    row_a, row_b = tables.rows([a, b]).tolist()
    a.status = SequenceStatus.FINISHED
    (row_c,) = tables.rows([c]).tolist()
    assert row_c == row_a  # a's row went back to the pool
    assert _table(tables, row_b, 1) == [11] and _table(tables, row_c, 1) == [12]
    # No finished sequence left to reclaim: the array grows instead of sharing a row.
    rows = tables.rows([b, c, d]).tolist()
    assert len(set(rows)) == 3
    assert [_table(tables, row, 1)[0] for row in rows] == [11, 12, 13]


def test_a_steps_table_follows_its_sequences_not_max_model_len():
    # max_model_len 1M at block 16: 65,536 blocks a row, of which these sequences use a few.
    tables = BlockTables(capacity=4, max_blocks=65_536)
    a, b = _seqs(2)
    a.block_table, b.block_table = [7, 8, 9], list(range(20))
    rows = tables.rows([a, b])
    assert tables.array.shape[1] < 64  # the host array widens with the sequences
    step = tables.gather(rows, 3)
    assert step.shape == (2, MIN_WIDTH) and step[0, :3].tolist() == [7, 8, 9]
    step = tables.gather(rows, 20)
    assert step.shape == (2, 32) and step[1, :20].tolist() == list(range(20))  # a power of two
    # Never wider than max_model_len's blocks, unless a sequence holds more.
    assert [padded_width(n, 100) for n in (1, 16, 17, 64, 65, 100, 101)] == [16, 16, 32, 64, 100, 100, 101]
