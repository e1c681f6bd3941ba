"""The decode graphs' input buffer: one upload fills every input, padding rows are inert, and the
token gather the graph starts with resolves placeholders from the sampled ids.

The layout is plain tensor code, checked here on the CPU; the graphs that read it run on the GPU
(test_gpu_parity.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuworker.engine.cuda_graphs import GraphInputs


@pytest.mark.parametrize("rows", [7, 8])
def test_upload_fills_every_input_and_pads_the_bucket(rows):
    inputs = GraphInputs(rows=rows, max_blocks=6, device=torch.device("cpu"))
    inputs.sampled[:3] = torch.tensor([501, 502, 503])  # the previous step's ids, on the device
    tables = np.array([[4, 9, 2], [7, 1, 0], [3, 5, 8]], dtype=np.int32)
    inputs.upload(
        size=4,
        known_ids=np.array([11, -1, 13]),
        placeholders=np.array([1]),
        sampled_rows=np.array([2]),
        positions=np.array([40, 17, 33]),
        slot_mapping=np.array([100, 200, 300]),
        seq_lens=np.array([41, 18, 34]),
        block_tables=tables,
    )
    assert inputs.sampled[:3].tolist() == [501, 502, 503]  # the upload leaves them alone
    resolved = torch.index_select(inputs.ids, 0, inputs.token_index[:4])
    assert resolved[:3].tolist() == [11, 503, 13]
    assert resolved[3] == 0  # a padding row reads token 0, a valid embedding row
    assert inputs.positions[:4].tolist() == [40, 17, 33, 0]
    assert inputs.slot_mapping[:4].tolist() == [100, 200, 300, -1]  # padding writes nothing
    assert inputs.seq_lens[:4].tolist() == [41, 18, 34, 0]  # and attends to nothing
    assert inputs.block_tables[:3, :3].tolist() == tables.tolist()
    for view in (
        inputs.ids,
        inputs.token_index,
        inputs.positions,
        inputs.slot_mapping,
        inputs.seq_lens,
        inputs.block_tables,
    ):
        assert view.data_ptr() % 16 == 0

    # A smaller step afterwards: its rows are rewritten, and a previous placeholder row no longer
    # points into the sampled ids.
    inputs.upload(
        size=1,
        known_ids=np.array([-1]),
        placeholders=np.array([0]),
        sampled_rows=np.array([0]),
        positions=np.array([41]),
        slot_mapping=np.array([101]),
        seq_lens=np.array([42]),
        block_tables=np.array([[4, 9, 2]], dtype=np.int32),
    )
    assert torch.index_select(inputs.ids, 0, inputs.token_index[:1]).tolist() == [501]
    assert inputs.positions[:1].tolist() == [41] and inputs.seq_lens[:1].tolist() == [42]


def test_windowed_upload_fills_the_window_pool_inputs_too():
    # A model with a window pool (engine.window_blocks): each block-table row holds the sequence's
    # window table after its block table, and the sliding layers' slots have their own part.
    inputs = GraphInputs(rows=4, max_blocks=5, device=torch.device("cpu"), windowed=True)
    plain = GraphInputs(rows=4, max_blocks=5, device=torch.device("cpu"))
    tables = np.array([[4, 9, 2], [7, 1, 0]], dtype=np.int32)
    windows = np.array([[0, 6, 3], [8, 2, 0]], dtype=np.int32)
    inputs.upload(
        size=4,
        known_ids=np.array([11, 12]),
        placeholders=np.array([], dtype=np.int64),
        sampled_rows=np.array([], dtype=np.int64),
        positions=np.array([40, 17]),
        slot_mapping=np.array([100, 200]),
        seq_lens=np.array([41, 18]),
        block_tables=tables,
        window_slot_mapping=np.array([50, 60]),
        window_block_tables=windows,
    )
    assert inputs.block_tables[:2, :3].tolist() == tables.tolist()
    assert inputs.window_block_tables[:2, :3].tolist() == windows.tolist()
    assert inputs.slot_mapping[:4].tolist() == [100, 200, -1, -1]
    assert inputs.window_slot_mapping[:4].tolist() == [50, 60, -1, -1]  # padding writes nothing
    assert inputs.window_slot_mapping.data_ptr() % 16 == 0
    # Without a window pool the layout is as before.
    assert plain.window_slot_mapping is None and plain.block_tables.shape == (4, 5)
    assert plain.block_tables.is_contiguous()


@pytest.mark.parametrize("windowed", [False, True])
def test_upload_copies_only_the_steps_columns_of_the_tables(windowed):
    # Tables as wide as a long max_model_len: a step of short sequences sends its own columns only,
    # and the rest keeps what it held (the kernels read a row only below its seq_len).
    inputs = GraphInputs(rows=4, max_blocks=4096, device=torch.device("cpu"), windowed=windowed)
    tables = np.array([[4, 9, 2], [7, 1, 0]], dtype=np.int32)
    window = dict(window_slot_mapping=np.array([50, 60]), window_block_tables=tables + 100) if windowed else {}
    written = [inputs.block_tables] + ([inputs.window_block_tables] if windowed else [])
    for view in written:
        view.fill_(-7)
    inputs.upload(
        size=2,
        known_ids=np.array([11, 12]),
        placeholders=np.array([], dtype=np.int64),
        sampled_rows=np.array([], dtype=np.int64),
        positions=np.array([40, 17]),
        slot_mapping=np.array([100, 200]),
        seq_lens=np.array([41, 18]),
        block_tables=tables,
        **window,
    )
    for view, expected in zip(written, (tables, tables + 100)):
        assert view[:2, :3].tolist() == expected.tolist()
        assert bool((view[:2, 3:] == -7).all()) and bool((view[2:] == -7).all())
    assert inputs.seq_lens[:2].tolist() == [41, 18]
