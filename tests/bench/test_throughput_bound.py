"""bench/throughput_bound.py: the work of bench/throughput.py's workload, counted by hand on a toy shape."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bound(bench_script):
    return bench_script("throughput_bound")


def test_work_and_least_time_of_two_requests(bound):
    # One layer, hidden 4, 2 heads of 2 dims, 1 KV head, MLP 8, vocabulary 10.
    cfg = {
        "hidden_size": 4,
        "num_hidden_layers": 1,
        "vocab_size": 10,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 8,
    }
    work = bound.workload_work(cfg, [([0] * 3, 2), ([0] * 5, 1)])
    projections = 4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 8  # q, k and v, o, gate/up/down = 144
    assert (work["prompt_tokens"], work["output_tokens"]) == (8, 3)
    # Prefill: every prompt token through the projections, lm_head (40) once a request; decode: the
    # first request's second token, lm_head included.
    assert work["gemm_flops"] == 2 * projections * 8 + 2 * 40 * 2 + 2 * (projections + 40)
    # Causal attention: 4 x heads x head_dim FLOPs per (query, key) pair, 6 + 15 pairs.
    assert work["attention_flops"] == 4 * 2 * 2 * (6 + 15)
    # The decode step reads the K and V of 4 positions: 1 KV head x 2 dims x 2 bytes each.
    assert work["kv_bytes"] == 4 * 2 * 1 * 2 * 2
    assert bound.least_time_s(work, 1e-12, 1e-12) == pytest.approx(
        work["gemm_flops"] + work["attention_flops"] + work["kv_bytes"]
    )
