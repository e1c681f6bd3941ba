"""DeepSeek-style MoE routing: softmax or sigmoid scores, experts chosen within the best groups.

Three methods, as transformers' DeepSeek-V2, DeepSeek-V3 and GLM-4.5 routers compute them (in
float32, from router logits computed in float32):

- "greedy" (DeepSeek-V2): softmax over the experts, the top_k of them.
- "group_limited_greedy" (DeepSeek-V2): softmax; the experts are split into n_group equal groups, a
  group scores its best expert, the topk_group best groups are kept (the others' scores set to 0),
  then the top_k.
- "noaux_tc" (DeepSeek-V3, GLM-4.5): sigmoid scores; a per-expert correction bias is added for the
  choice only: groups score the sum of their two best biased scores, the topk_group best are kept
  (the others' set to -inf), then the top_k by biased score. The weights are the unbiased sigmoid
  scores of the chosen experts.

Then, when `normalize`, the weights are divided by their sum (+1e-20), and all are multiplied by
routed_scaling_factor. `route_grouped_reference` is the torch version (the CPU path, the grouped
GPU path and the reference: device ops only, no host reads); `route_grouped` the same in one Triton
launch of one program per token, for decode steps (captured in CUDA graphs). The kernel takes the
top_k in descending order of the choice score, the lower expert first on ties.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gpuworker.kernels.launch import FLOAT_DTYPES, check_tensor, lazy_jit, next_power_of_2, pdl_options
from gpuworker.kernels.moe.grouped_routing import GroupedRouting

__all__ = ["GroupedRouting", "route_grouped", "route_grouped_reference"]


def route_grouped_reference(
    router_logits: torch.Tensor, routing: GroupedRouting, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64), as
    transformers' routers compute them. correction_bias [E] (noaux_tc's e_score_correction_bias):
    added to the scores for the choice only."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if routing.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.topk_method != "greedy":
        tokens, experts = choice.shape
        grouped = choice.view(tokens, routing.n_group, experts // routing.n_group)
        if routing.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=routing.topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        fill = float("-inf") if routing.topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~expert_mask, fill)
    ids = torch.topk(choice, k=routing.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if routing.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids


def _route_grouped_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_l,
    scaling,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_SCORE: tl.constexpr,  # 0: no group limit; 1: a group's best score; 2: the sum of its best two
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    experts = tl.arange(0, BLOCK_E)
    valid = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        scores = tl.exp(logits - tl.max(logits, axis=0))
        scores = scores / tl.sum(scores, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    if GROUP_SCORE != 0:
        group_size: tl.constexpr = NUM_EXPERTS // N_GROUP
        group_of = experts // group_size
        groups = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            member = valid & (group_of == g)
            best = tl.max(tl.where(member, choice, float("-inf")), axis=0)
            if GROUP_SCORE == 2:  # plus the best of the others (the first best left out: ties count twice)
                index = tl.min(tl.where(member & (choice == best), experts, BLOCK_E), axis=0)
                best = best + tl.max(tl.where(member & (experts != index), choice, float("-inf")), axis=0)
            group_scores = tl.where(groups == g, best, group_scores)
        kept = tl.zeros([BLOCK_E], dtype=tl.int1)
        open_groups = groups < N_GROUP
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(open_groups, group_scores, float("-inf")), axis=0)
            group = tl.min(tl.where(open_groups & (group_scores == top), groups, BLOCK_G), axis=0)
            open_groups = open_groups & (groups != group)
            kept = kept | (group_of == group)
        choice = tl.where(kept, choice, float("-inf") if GROUP_SCORE == 2 else 0.0)
    # The top_k by choice score, the first index on ties; NaN scores (a broken model) can make the
    # index BLOCK_E, past every rank's experts, which the experts kernels skip.
    taken = ~valid
    slots = tl.arange(0, BLOCK_TOP_K)
    chosen_weights = tl.zeros([BLOCK_TOP_K], dtype=tl.float32)
    chosen_ids = tl.zeros([BLOCK_TOP_K], dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), choice), axis=0)
        index = tl.min(tl.where(~taken & (choice == best), experts, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(experts == index, scores, 0.0), axis=0)
        chosen_weights = tl.where(slots == k, weight, chosen_weights)
        chosen_ids = tl.where(slots == k, index.to(tl.int64), chosen_ids)
        taken = taken | (experts == index)
    if NORMALIZE:
        chosen_weights = chosen_weights / (tl.sum(chosen_weights, axis=0) + 1e-20)
    chosen_weights = chosen_weights * scaling
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weights, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


# The scaling factor is a model constant, but a float: one variant whatever its value.
_route_grouped = lazy_jit(_route_grouped_kernel, do_not_specialize=("scaling",))


def route_grouped(
    router_logits: torch.Tensor, routing: GroupedRouting, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """route_grouped_reference in one launch (see the module doc for the order of ties)."""
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_experts = router_logits.shape
    routing.check(num_experts)
    if router_logits.stride(1) != 1:
        raise ValueError("router_logits needs a contiguous last dimension")
    device = router_logits.device
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        if correction_bias.shape != (num_experts,) or correction_bias.stride(0) != 1:
            raise ValueError(
                f"correction_bias must be a contiguous [{num_experts}], got {tuple(correction_bias.shape)}"
            )
    top_k = routing.top_k
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens:
        group_score = 0 if not routing.limits_groups else (2 if routing.topk_method == "noaux_tc" else 1)
        _route_grouped[(num_tokens,)](
            router_logits,
            router_logits if correction_bias is None else correction_bias,
            weights,
            ids,
            router_logits.stride(0),
            float(routing.scaling),
            NUM_EXPERTS=num_experts,
            TOP_K=top_k,
            BLOCK_E=next_power_of_2(num_experts),
            BLOCK_TOP_K=next_power_of_2(top_k),
            SIGMOID=routing.scoring_func == "sigmoid",
            HAS_BIAS=correction_bias is not None,
            GROUP_SCORE=group_score,
            N_GROUP=routing.n_group,
            TOPK_GROUP=routing.topk_group,
            BLOCK_G=next_power_of_2(routing.n_group),
            NORMALIZE=bool(routing.normalize),
            num_warps=1 if num_experts <= 128 else 4,
            **pdl_options(device),
        )
    return weights, ids
