"""Expert parallelism by dispatch and combine (models.expert_parallel) on two gloo ranks: the split
layer gives the unsplit layer's output, each rank routes only its slice of the tokens, and each
rank's experts compute only the choices made of them."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from gpuworker.models.config import MoEConfig
from gpuworker.models.expert_parallel import token_slice
from gpuworker.models.moe import SparseMoE
from gpuworker.models.tensor_parallel import ParallelContext

HIDDEN = 32
WORLD = 2
# Ragged and tiny batches: a slice may be shorter than the others, or empty (1 token, 2 ranks).
TOKEN_COUNTS = (1, 2, 5, 16)


def _config(shared: int) -> MoEConfig:
    return MoEConfig(
        num_experts=4,
        top_k=2,
        expert_intermediate_size=24,
        norm_topk_prob=True,
        shared_expert_intermediate_size=shared,
        sparse_layers=(True,),
        checkpoint_prefix="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
    )


def _whole_layer(shared: int) -> SparseMoE:
    torch.manual_seed(0)
    layer = SparseMoE(HIDDEN, _config(shared))
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    return layer


def _rank_layer(whole: SparseMoE, shared: int, rank: int) -> SparseMoE:
    """This rank's shard of `whole`, as the loader fills it: its experts' rows, its slice of the
    shared expert's intermediate size."""
    layer = SparseMoE(HIDDEN, _config(shared), ParallelContext(rank, WORLD, dispatch_experts=True))
    layer.gate.weight.data.copy_(whole.gate.weight)
    for name in ("w13", "w2"):
        rows = getattr(layer, name).shape[0]
        getattr(layer, name).data.copy_(getattr(whole, name)[rank * rows : (rank + 1) * rows])
    if shared:
        part = shared // WORLD
        gate, up = whole.shared_expert.gate_up_proj.weight.split(shared)
        mine = slice(rank * part, (rank + 1) * part)
        layer.shared_expert.gate_up_proj.weight.data.copy_(torch.cat([gate[mine], up[mine]]))
        layer.shared_expert.down_proj.weight.data.copy_(whole.shared_expert.down_proj.weight[:, mine])
        layer.shared_expert_gate.weight.data.copy_(whole.shared_expert_gate.weight)
    return layer


def _rank_main(rank: int, store_path: str, shared: int, out_dir: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        whole = _whole_layer(shared)
        layer = _rank_layer(whole, shared, rank)
        routed, computed = [], []
        layer.gate.register_forward_hook(lambda _m, args, _out: routed.append(args[0].shape[0]))
        experts = layer._experts

        def counting(x, weights, ids):
            computed.append(ids.reshape(-1).tolist())
            return experts(x, weights, ids)

        layer._experts = counting
        results = {}
        torch.manual_seed(1)
        for tokens in TOKEN_COUNTS:
            x = torch.randn(tokens, HIDDEN)  # the same on both ranks, as under tensor parallelism
            with torch.inference_mode():
                results[tokens] = (x, layer(x), whole(x))
        torch.save({"results": results, "routed": routed, "computed": computed}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path, shared: int) -> list[dict]:
    spawn = multiprocessing.get_context("spawn")
    store = str(tmp_path / "store")
    processes = [spawn.Process(target=_rank_main, args=(r, store, shared, str(tmp_path))) for r in range(WORLD)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("shared", [0, 16], ids=["routed-only", "shared-expert"])
def test_dispatch_and_combine_equal_the_unsplit_layer(tmp_path, shared):
    ranks = _run_ranks(tmp_path, shared)
    for tokens in TOKEN_COUNTS:
        for rank in ranks:
            x, split, whole = rank["results"][tokens]
            torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    # A real dispatch: each rank routes its slice of the tokens, not all of them ...
    for rank, got in enumerate(ranks):
        assert got["routed"] == [token_slice(t, ParallelContext(rank, WORLD))[1] for t in TOKEN_COUNTS]
    # ... and its experts compute exactly the choices made of them, by either rank's tokens.
    experts_per_rank = 4 // WORLD
    for rank, got in enumerate(ranks):
        assert all(e // experts_per_rank == rank for ids in got["computed"] for e in ids)
    total = sum(len(ids) for got in ranks for ids in got["computed"])
    assert total == sum(TOKEN_COUNTS) * 2  # every (token, expert) choice once, on one rank


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (5, [(0, 3, 3), (3, 2, 3)]),
        (1, [(0, 1, 1), (1, 0, 1)]),
        (0, [(0, 0, 0), (0, 0, 0)]),
        (4, [(0, 2, 2), (2, 2, 2)]),
    ],
)
def test_token_slices_cover_the_batch_once(tokens, expected):
    assert [token_slice(tokens, ParallelContext(rank, 2)) for rank in range(2)] == expected
