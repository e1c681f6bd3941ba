"""The MoE decode kernels (routing, gate/up, down) against their torch references and the dense
experts reference, and the choice between them and the grouped kernels."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.moe.decode import (
    DECODE_MAX_PAIRS,
    DEFAULT_CONFIG,
    ENV_OVERRIDE,
    TABLE_KEY,
    DecodeConfig,
    Tile,
    decode_config,
    moe_decode,
    moe_decode_reference,
    route_reference,
    route_top_k,
)
from gpuworker.models.moe import experts_reference
from tests.kernels.conftest import DEVICE, ON_CUDA, TOLERANCES

# (hidden, expert intermediate, experts): not multiples of the tiles, so the masks and clamped rows are used.
SHAPES = [(64, 48, 4), (96, 80, 8)] if not ON_CUDA else [(64, 48, 4), (2048, 768, 128), (4096, 14336, 8)]
# Tiles wider and narrower than the tiny shapes, with one and several pipeline stages.
CONFIGS = [
    DEFAULT_CONFIG,
    DecodeConfig(gate_up=Tile(8, 32, 2, 1), down=Tile(32, 16, 4, 2)),
    DecodeConfig(gate_up=Tile(64, 128, 4, 2), down=Tile(4, 512, 8, 1)),
]


def problem(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (x, w13, w2, logits)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (3, 8, 2), (8, 60, 4), (2, 128, 8), (5, 7, 7), (4, 16, 1)])
def test_routing_matches_the_reference(tokens, experts, top_k, normalize, dtype):
    g = torch.Generator().manual_seed(experts + tokens)
    logits = (3 * torch.randn(tokens, experts, generator=g)).to(dtype).to(DEVICE)
    weights, ids = route_top_k(logits, top_k, normalize)
    expected_weights, expected_ids = route_reference(logits, top_k, normalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)


def test_routing_breaks_ties_towards_the_lower_expert():
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[1, 5] = logits[1, 2] = 1.0
    weights, ids = route_top_k(logits, 3, normalize=True)
    assert ids.tolist() == [[0, 1, 2], [2, 5, 0]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3, device=DEVICE))
    torch.testing.assert_close(weights[1, 0], weights[1, 1])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the NaN row
def test_a_token_with_nan_logits_reads_nothing_out_of_bounds_and_leaves_the_others_alone():
    # Whatever the top-k of NaNs is (a GPU's max may skip them), its ids are experts or 4, the index
    # past them all (BLOCK_E), which the experts kernels skip.
    x, w13, w2, logits = problem(2, 64, 48, 4, 2, torch.float32, seed=3)
    logits[0] = float("nan")
    weights, ids = route_top_k(logits, 2, normalize=True)
    assert 0 <= ids.min() and ids.max() <= 4
    out = moe_decode(x, w13, w2, weights, ids)
    expected_weights, expected_ids = route_reference(logits[1:], 2, normalize=True)
    assert torch.equal(ids[1:], expected_ids)
    torch.testing.assert_close(
        out[1:], experts_reference(x[1:], w13, w2, expected_weights, expected_ids), **TOLERANCES[torch.float32]
    )


def test_routing_refuses_bad_arguments():
    logits = torch.randn(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="top_k must be an int in 1..4"):
        route_top_k(logits, 5, normalize=True)
    with pytest.raises(ValueError, match="router_logits must have 2 dimensions"):
        route_top_k(logits[0], 2, normalize=True)
    weights, ids = route_top_k(logits[:0], 2, normalize=True)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (2, 1), (5, 4), (8, 3)])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_experts_match_the_references(shape, tokens, top_k, dtype):
    hidden, inter, experts = shape
    if top_k > experts:
        pytest.skip("more experts per token than experts")
    x, w13, w2, logits = problem(tokens, hidden, inter, experts, top_k, dtype)
    weights, ids = route_top_k(logits, top_k, normalize=True)
    out = moe_decode(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, moe_decode_reference(x, w13, w2, weights, ids), **TOLERANCES[dtype])
    dense = experts_reference(x.float(), w13.float(), w2.float(), weights, ids).to(dtype)
    torch.testing.assert_close(out, dense, **TOLERANCES[dtype])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_every_tile_gives_the_same_answer(config):
    hidden, inter, experts = SHAPES[1]
    x, w13, w2, logits = problem(3, hidden, inter, experts, 2, torch.float32, seed=1)
    weights, ids = route_top_k(logits, 2, normalize=False)
    expected = experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(
        moe_decode(x, w13, w2, weights, ids, config=config), expected, **TOLERANCES[torch.float32]
    )


@pytest.mark.parametrize("first,count", [(0, 4), (4, 4), (2, 2), (7, 1)])
def test_a_range_of_the_experts_computes_only_their_choices(first, count):
    """Expert parallel: over experts [first, first + count) only (a rank's weights, global ids), the
    other choices add nothing, tokens none of whose experts are here get exactly 0, and the
    ranks' parts add up to the whole."""
    hidden, inter, experts, top_k = 64, 48, 8, 2
    x, w13, w2, logits = problem(6, hidden, inter, experts, top_k, torch.float32, seed=first)
    weights, ids = route_top_k(logits, top_k, normalize=True)
    mine = (ids >= first) & (ids < first + count)
    local = slice(first, first + count)
    out = moe_decode(x, w13[local].contiguous(), w2[local].contiguous(), weights, ids, first)
    restricted = experts_reference(x, w13, w2, torch.where(mine, weights, 0.0), ids)
    torch.testing.assert_close(out, restricted, **TOLERANCES[torch.float32])
    assert (out[~mine.any(dim=1)] == 0).all()
    parts = [
        moe_decode(x, w13[lo:hi].contiguous(), w2[lo:hi].contiguous(), weights, ids, lo)
        for lo, hi in ((0, first), (first + count, experts))
        if hi > lo
    ]
    torch.testing.assert_close(sum(parts, out), moe_decode(x, w13, w2, weights, ids), **TOLERANCES[torch.float32])


def test_the_sparse_reference_equals_the_dense_one():
    x, w13, w2, logits = problem(4, 64, 48, 8, 3, torch.float32, seed=2)
    weights, ids = route_reference(logits, 3, normalize=False)
    torch.testing.assert_close(
        moe_decode_reference(x, w13, w2, weights, ids),
        experts_reference(x, w13, w2, weights, ids),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        moe_decode_reference(x, w13[2:5], w2[2:5], weights, ids, 2),
        experts_reference(x, w13[2:5], w2[2:5], weights, ids, 2),
        rtol=1e-5,
        atol=1e-5,
    )


def test_no_tokens_and_bad_arguments():
    x, w13, w2, logits = problem(2, 64, 48, 4, 2, torch.float32)
    weights, ids = route_reference(logits, 2, normalize=True)
    assert moe_decode(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 64)
    with pytest.raises(ValueError, match="do not fit"):
        moe_decode(x, w13[:, :-2], w2, weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        moe_decode(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="ids must have dtype"):
        moe_decode(x, w13, w2, weights, ids.to(torch.int32))


def test_decode_config_up_to_the_pair_limit(monkeypatch, kernel_configs):
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    assert decode_config(1, 8, 2048, 768) == DEFAULT_CONFIG
    assert decode_config(DECODE_MAX_PAIRS // 8, 8, 2048, 768) == DEFAULT_CONFIG
    assert decode_config(DECODE_MAX_PAIRS // 8 + 1, 8, 2048, 768) is None
    assert decode_config(0, 8, 2048, 768) is None
    # A measured table: its entry for the token count's bucket, "grouped" sending it to the grouped kernels.
    tile = "gate_up=n32-k128-w8-p2,down=n4-k512-w4-p3"
    kernel_configs(
        "moe_decode",
        TABLE_KEY,
        [
            dict(hidden=2048, inter=768, top_k=8, tokens=1, config=tile),
            dict(hidden=2048, inter=768, top_k=8, tokens=4, config="grouped"),
        ],
    )
    assert decode_config(1, 8, 2048, 768) == DecodeConfig(Tile(32, 128, 8, 2), Tile(4, 512, 4, 3))
    assert decode_config(3, 8, 2048, 768) is None
    assert decode_config(2, 8, 2048, 768) == DEFAULT_CONFIG
    assert decode_config(1, 8, 4096, 768) == DEFAULT_CONFIG


def test_the_environment_overrides_the_table(monkeypatch):
    monkeypatch.setenv(ENV_OVERRIDE, "gate_up=n8-k512-w4-p1,down=n16-k256-w8-p4")
    assert decode_config(2, 8, 2048, 768).name == "gate_up=n8-k512-w4-p1,down=n16-k256-w8-p4"
    assert decode_config(9, 8, 2048, 768) is None  # past the pair limit whatever it says
    monkeypatch.setenv(ENV_OVERRIDE, "grouped")
    assert decode_config(1, 8, 2048, 768) is None
    for bad, message in [
        ("gate_up=n8-k512-w4-p1", "gate_up=<tile>,down=<tile>"),
        ("gate_up=n8-k512-w4,down=n8-k512-w4-p1", "n<BLOCK_N>-k<BLOCK_K>"),
        ("gate_up=n12-k512-w4-p1,down=n8-k512-w4-p1", "block_n must be a positive power of 2"),
        ("gate_up=n8-k512-w4-p0,down=n8-k512-w4-p1", "num_stages"),
    ]:
        monkeypatch.setenv(ENV_OVERRIDE, bad)
        with pytest.raises(ValueError, match=message):
            decode_config(1, 8, 2048, 768)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need CUDA")
def test_routing_and_experts_replay_in_a_cuda_graph():
    hidden, inter, experts = 2048, 768, 128
    x, w13, w2, logits = problem(4, hidden, inter, experts, 8, torch.bfloat16)

    def step():
        weights, ids = route_top_k(logits, 8, normalize=True)
        return moe_decode(x, w13, w2, weights, ids)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)  # the replay read the new inputs
    torch.testing.assert_close(captured, step(), rtol=0, atol=0)
