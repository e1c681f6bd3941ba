"""engine.multimodal.step_rotary_positions over a step that mixes text-only requests, decodes of
image requests and prefill chunks of them: each token's three rows as the request's own table
gives them (its prompt) or position + delta (past it), and a decode never reads its request's
table (the step's decodes are set at once, not request by request)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from gpuworker.engine.multimodal import step_rotary_positions


class Untouchable(np.ndarray):
    """A request's table that only a prompt token may index (its shape may be read)."""

    def __getitem__(self, key):
        raise AssertionError("a decode read its request's rotary table")


def _entry(prompt: int, start: int, new: int, seed: int | None, untouchable: bool = False):
    mm = None
    if seed is not None:
        table = np.random.default_rng(seed).integers(0, 50, (3, prompt))
        mm = SimpleNamespace(rotary_positions=table.view(Untouchable) if untouchable else table, rotary_delta=seed - 7)
    seq = SimpleNamespace(group=SimpleNamespace(multimodal=mm), num_prompt_tokens=prompt)
    return SimpleNamespace(seq=seq, start=start, num_new_tokens=new)


def _expected(entries, positions, query_start_loc) -> np.ndarray:
    rows = np.broadcast_to(positions, (3, len(positions))).copy()
    for i, entry in enumerate(entries):
        mm = entry.seq.group.multimodal
        for row in range(query_start_loc[i], query_start_loc[i + 1]):
            if mm is None:
                continue
            p = positions[row]
            width = mm.rotary_positions.shape[1]
            rows[:, row] = np.asarray(mm.rotary_positions.view(np.ndarray)[:, p]) if p < width else p + mm.rotary_delta
    return rows


def test_a_mixed_step_gets_each_tokens_rows_and_decodes_never_read_their_table():
    entries = [
        _entry(12, 15, 1, seed=3, untouchable=True),  # decodes
        _entry(9, 9, 1, seed=5, untouchable=True),
        _entry(20, 20, 1, seed=None),  # a text-only request
        _entry(10, 0, 6, seed=11),  # a prefill chunk inside the prompt
        _entry(8, 5, 3, seed=13),  # the prompt's last chunk: its last tokens
        _entry(6, 2, 6, seed=17),  # a chunk that runs past a 6-token prompt (prompt filled at once)
    ]
    lengths = [e.num_new_tokens for e in entries]
    query_start_loc = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.concatenate([np.arange(e.start, e.start + e.num_new_tokens) for e in entries])
    got = step_rotary_positions(entries, positions, query_start_loc)
    assert got.shape == (3, len(positions))
    assert np.array_equal(got, _expected(entries, positions, query_start_loc))


def test_decodes_alone_are_one_row_and_text_alone_is_none():
    entries = [_entry(12, 15, 1, seed=3, untouchable=True), _entry(20, 20, 1, seed=None)]
    positions, query_start_loc = np.array([15, 20]), np.array([0, 1, 2])
    assert step_rotary_positions(entries, positions, query_start_loc).tolist() == [15 + 3 - 7, 20]
    assert step_rotary_positions([_entry(20, 20, 1, seed=None)], np.array([20]), np.array([0, 1])) is None
