"""Which captured decode graph a batch runs in: the lookup table DecodeGraphs rebuilds as each graph
is captured. Pure Python, checked on the CPU; the graphs themselves run on the GPU (test_gpu_parity.py)."""

from __future__ import annotations

from gpuworker.engine.cuda_graphs import bucket_sizes, padded_sizes


def test_nothing_captured_runs_every_batch_eager():
    assert padded_sizes({}, 8) == (None,) * 9


def test_a_batch_pads_up_to_the_smallest_captured_graph_as_each_is_added():
    order = [48, 1, 32, 24, 16, 8, 4, 2]  # deferred capture: the largest, then batch 1, then the rest
    assert sorted(order) == bucket_sizes(48)
    assert padded_sizes(order[:1], 48) == (48,) * 49  # the first graph serves every batch
    assert padded_sizes(order[:2], 48)[:3] == (1, 1, 48)
    assert padded_sizes(order, 48)[17:25] == (24,) * 8
    for captured in (order[:k] for k in range(1, len(order) + 1)):
        # the scan the table replaces: the smallest captured size that holds n rows
        scanned = tuple(min((size for size in captured if size >= n), default=None) for n in range(49))
        assert padded_sizes(captured, 48) == scanned


def test_a_batch_larger_than_every_captured_graph_runs_eager():
    assert padded_sizes({1, 2, 4}, 8) == (1, 1, 2, 4, 4, None, None, None, None)
