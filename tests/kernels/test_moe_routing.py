"""DeepSeek-style routing (kernels.moe.routing): the torch reference against transformers' own router
modules on the same weights, the Triton kernel against the reference, and the experts kernels fed by
it against the dense experts reference."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.moe.decode import moe_decode
from gpuworker.kernels.moe.fused import fused_moe
from gpuworker.kernels.moe.routing import GroupedRouting, route_grouped, route_grouped_reference
from gpuworker.models.moe import experts_reference
from tests.kernels.conftest import DEVICE, ON_CUDA, TOLERANCES

# (transformers config class, router class, its config fields, our routing)
ROUTERS = {
    "softmax-greedy": (
        "DeepseekV2Config",
        "deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
        {"n_routed_experts": 16, "num_experts_per_tok": 3, "topk_method": "greedy", "routed_scaling_factor": 1.0},
        GroupedRouting(top_k=3),
    ),
    "softmax-group-limited-scaled": (
        "DeepseekV2Config",
        "deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
        {
            "n_routed_experts": 16,
            "num_experts_per_tok": 3,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 16.0,
        },
        GroupedRouting(top_k=3, topk_method="group_limited_greedy", n_group=4, topk_group=2, scaling=16.0),
    ),
    "sigmoid-noaux-tc-groups-v3": (
        "DeepseekV3Config",
        "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
        {
            "n_routed_experts": 32,
            "num_experts_per_tok": 4,
            "n_group": 8,
            "topk_group": 3,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
        },
        GroupedRouting(top_k=4, topk_method="noaux_tc", n_group=8, topk_group=3, normalize=True, scaling=2.5),
    ),
    "sigmoid-noaux-tc-glm-unnormalised": (
        "Glm4MoeConfig",
        "glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter",
        {"n_routed_experts": 12, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "norm_topk_prob": False},
        GroupedRouting(top_k=2, topk_method="noaux_tc"),
    ),
}


def hf_router(name: str, hidden: int, seed: int):
    import importlib

    import transformers

    config_name, router_path, fields, routing = ROUTERS[name]
    config = getattr(transformers, config_name)(hidden_size=hidden, **fields)
    module_name, class_name = router_path.rsplit(".", 1)
    module = importlib.import_module(f"transformers.models.{module_name}")
    router = getattr(module, class_name)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.5 * torch.randn(bias.shape, generator=g))
    return router, routing, bias


def sorted_choice(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) in ascending expert order: transformers' routers return them unsorted."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_reference_matches_transformers_router(name):
    router, routing, bias = hf_router(name, hidden=32, seed=len(name))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    weights, ids = route_grouped_reference(logits, routing, bias)
    ours, expected = sorted_choice(weights, ids), sorted_choice(hf_weights.float(), hf_ids)
    assert torch.equal(ours[1], expected[1])
    torch.testing.assert_close(ours[0], expected[0], atol=1e-6, rtol=1e-6)


def test_the_bias_chooses_but_does_not_weigh():
    routing = GroupedRouting(top_k=1, topk_method="noaux_tc")
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.0]])
    weights, ids = route_grouped_reference(logits, routing, torch.tensor([0.0, 0.0, 5.0, 0.0]))
    assert ids.tolist() == [[2]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0]])))


def test_groups_limit_the_choice():
    # Expert 0 is the best overall, but its group (0, 1) loses to group (2, 3) on the sum of two.
    routing = GroupedRouting(top_k=2, topk_method="noaux_tc", n_group=2, topk_group=1)
    logits = torch.tensor([[3.0, -3.0, 1.0, 1.0]])
    assert route_grouped_reference(logits, routing)[1].sort().values.tolist() == [[2, 3]]
    greedy = GroupedRouting(top_k=2, topk_method="group_limited_greedy", n_group=2, topk_group=1)
    assert route_grouped_reference(logits, greedy)[1].sort().values.tolist() == [[0, 1]]


KERNEL_CASES = [
    (GroupedRouting(top_k=2), False),
    (GroupedRouting(top_k=6, normalize=True, scaling=1.5), False),
    (GroupedRouting(top_k=4, topk_method="group_limited_greedy", n_group=4, topk_group=2, scaling=16.0), False),
    (GroupedRouting(top_k=4, topk_method="noaux_tc", n_group=8, topk_group=3, normalize=True, scaling=2.5), True),
    (GroupedRouting(top_k=8, topk_method="noaux_tc", n_group=1, topk_group=1, normalize=True), True),
    (GroupedRouting(top_k=3, topk_method="noaux_tc", n_group=4, topk_group=4), False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", [32, 48])
@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
def test_kernel_matches_the_reference(case, experts, dtype):
    routing, with_bias = KERNEL_CASES[case]
    g = torch.Generator().manual_seed(case * 100 + experts)
    # Distinct logits in every row (multiples of 1/8, exact in bfloat16): random bfloat16 logits tie,
    # and ties leave the choice to each top-k's order, which differs between the kernel and torch's
    # CUDA topk.
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(5)])
    logits = ((ranks - experts // 2) / 8).to(dtype).to(DEVICE)
    bias = (0.3 * torch.randn(experts, generator=g)).to(DEVICE) if with_bias else None
    weights, ids = route_grouped(logits, routing, bias)
    expected_weights, expected_ids = route_grouped_reference(logits, routing, bias)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    # The kernel returns the top_k in descending order of choice, as torch.topk does.
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens", [3, 40])
def test_experts_kernels_take_the_new_weights(tokens):
    """Weights above one (routed_scaling_factor) and ids from group-limited routing through both
    experts kernels."""
    hidden, inter, experts = 64, 48, 16
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=g).to(DEVICE)
    bias = (0.3 * torch.randn(experts, generator=g)).to(DEVICE)
    routing = GroupedRouting(top_k=3, topk_method="noaux_tc", n_group=4, topk_group=2, normalize=True, scaling=2.5)
    weights, ids = route_grouped(logits, routing, bias)
    expected = experts_reference(x, w13, w2, *route_grouped_reference(logits, routing, bias))
    torch.testing.assert_close(moe_decode(x, w13, w2, weights, ids), expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "routing,field",
    [
        (GroupedRouting(top_k=2, topk_method="group_limited_greedy", n_group=4, topk_group=5), "topk_group"),
        (GroupedRouting(top_k=2, topk_method="noaux_tc", n_group=3), "n_group"),
        (GroupedRouting(top_k=2, topk_method="top1"), "topk_method"),
        (GroupedRouting(top_k=2, topk_method="noaux_tc", n_group=16, topk_group=2), "noaux_tc"),
        (GroupedRouting(top_k=9, topk_method="noaux_tc", n_group=4, topk_group=2), "num_experts_per_tok"),
        (GroupedRouting(top_k=2, scaling=0.0), "routed_scaling_factor"),
    ],
)
def test_bad_routing_is_refused_naming_the_field(routing, field):
    with pytest.raises(ValueError, match=field):
        routing.check(16)
    with pytest.raises(ValueError, match=field):
        route_grouped(torch.zeros(1, 16, device=DEVICE), routing)


@pytest.mark.parametrize("tokens", [2, 40], ids=["decode-kernels", "grouped-kernels"])
@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v2"])
def test_sparse_moe_on_the_kernels_equals_its_cpu_path(model_type, tokens):
    """SparseMoE's GPU path (routing launch or torch routing, then the experts kernels) against its
    CPU path (torch routing, dense experts reference), with a DeepSeek-style router."""
    from gpuworker.models.config import deepseek_moe_config
    from gpuworker.models.moe import SparseMoE

    fields = {"model_type": model_type, "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 24}
    if model_type == "glm4_moe":
        fields.update(n_group=4, topk_group=2, routed_scaling_factor=2.5)
    else:
        fields.update(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0)
    config = deepseek_moe_config({**fields, "num_hidden_layers": 1, "first_k_dense_replace": 0})
    hidden = 64
    with torch.device("meta"):
        moe = SparseMoE(hidden, config)
    moe = moe.to_empty(device=DEVICE)
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_((torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5).to(param.dtype))
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    reference = experts_reference(
        x, moe.w13.view(16, -1, hidden), moe.w2.view(16, hidden, -1), *moe.route(x), moe.first_expert
    )
    with torch.no_grad():
        torch.testing.assert_close(moe.kernel_experts(x), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("kernel", [True, False], ids=["routing-launch", "torch-routing"])
def test_grouped_routing_replays_in_a_cuda_graph(kernel):
    # Both routings run without host reads: DeepSeek-V3's shape, captured and replayed on new logits.
    routing = GroupedRouting(top_k=8, topk_method="noaux_tc", n_group=8, topk_group=4, normalize=True, scaling=2.5)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 256, generator=g).to(DEVICE)
    bias = (0.1 * torch.randn(256, generator=g)).to(DEVICE)

    def step():
        return (route_grouped if kernel else route_grouped_reference)(logits, routing, bias)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured[1], eager[1])
    expected = step()
    assert torch.equal(captured[1], expected[1])
    torch.testing.assert_close(captured[0], expected[0], rtol=0, atol=0)
