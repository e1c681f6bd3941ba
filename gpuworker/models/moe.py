"""The sparse mixture-of-experts MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, and with DeepSeek-style routing
(kernels.moe.routing) of DeepSeek-V2/V3 and GLM-4.5 (models.config.MoEConfig).

The experts' weights are stacked expert-major into two parameters, so the loader fills them as row
ranges like any fused projection: w13 [E * 2I, H] holds each expert's gate rows then its up rows,
w2 [E * H, I] each expert's down projection. On the GPU the experts run in Triton kernels
with no host syncs, so decode steps can be captured in CUDA graphs: for a few tokens the decode path
(kernels.moe_decode: routing in one launch, then one GEMV-like program per pair and row block), else
the grouped one (kernels.fused_moe: tokens grouped by expert, one grouped GEMM per projection,
SiLU-and-mul fused); on the CPU in `experts_reference`, which computes what transformers computes,
densely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuworker.kernels.moe.decode import route_reference
from gpuworker.kernels.moe.routing import route_grouped_reference
from gpuworker.models.config import MoEConfig
from gpuworker.models.expert_parallel import dispatch_combine, gather_tokens, token_slice
from gpuworker.models.layers import GatedMLP, Linear
from gpuworker.models.tensor_parallel import ParallelContext


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """sum over each token's chosen experts e of weight * down_e(silu(gate_e(x)) * up_e(x)), for the
    experts e these weights hold: first_expert..first_expert+E-1 (a rank's share under expert
    parallelism; choices of other experts add nothing here).

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights, ids [T, top_k] (global ids). Every expert runs on every
    token, weighted 0 where not chosen: E / top_k times the work of the sparse kernel, but nothing
    is read on the host (the model has no data-dependent control flow) and, as in transformers, the
    experts' contributions are added in expert order."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for local in range(w13.shape[0]):
        weight = torch.where(ids == first_expert + local, weights, 0.0).sum(dim=-1, keepdim=True)
        gate, up = F.linear(x, w13[local]).split(inter, dim=-1)
        out += (F.linear(F.silu(gate) * up, w2[local]) * weight).to(x.dtype)
    return out


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, config: MoEConfig, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = config
        # Expert parallel: this rank holds (and loads) only its experts [first_expert, first_expert +
        # num_local_experts) and its slice of the shared expert. Either every token is routed over all
        # the experts, the rank computes only the choices of its own, and forward sums the ranks'
        # partial outputs in one all-reduce; or (parallel.dispatch_experts) the rank routes its slice
        # of the tokens and sends each choice to its expert's rank (models.expert_parallel).
        self.parallel = parallel
        self.first_expert, experts = (
            (0, config.num_experts) if parallel is None else parallel.split(config.num_experts, "num_experts")
        )
        self.num_local_experts = experts
        inter = config.expert_intermediate_size
        self.hidden_size = hidden_size
        self.gate = Linear(hidden_size, config.num_experts)  # the router
        # noaux_tc's per-expert shift of the scores that choose the experts (DeepSeek-V3, GLM-4.5).
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(config.num_experts), requires_grad=False) if config.router_bias else None
        )
        self.w13 = nn.Parameter(torch.empty(experts * 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts * hidden_size, inter), requires_grad=False)
        shared = config.shared_expert_intermediate_size
        if parallel is not None and shared:
            shared = parallel.split(shared, "shared_expert_intermediate_size")[1]
        self.shared_expert = GatedMLP(hidden_size, shared, False) if shared else None
        self.shared_expert_gate = Linear(hidden_size, 1) if shared and config.shared_expert_gated else None
        # The routed experts of a block FP8 checkpoint (models.quantization.block_fp8_experts, set by
        # install_quantized_linears in place of w13 and w2, which are then None).
        self.block_fp8_experts: nn.Module | None = None

    def _apply(self, fn, recurse=True):  # a float32 router stays float32 across model.to(dtype)
        super()._apply(fn, recurse)
        if self.config.router_float32:
            self.gate.weight = nn.Parameter(self.gate.weight.float(), requires_grad=False)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias = nn.Parameter(self.e_score_correction_bias.float(), requires_grad=False)
        return self

    def route(self, x: torch.Tensor, launch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, top_k] float32, global expert ids [T, top_k] int64). `launch`: in
        one Triton launch (the decode path's), else in torch (device ops, no host reads)."""
        config = self.config
        if config.router_float32:  # as transformers' DeepSeek routers: float32 input and weight
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)
        if config.routing is not None:
            if launch:
                from gpuworker.kernels.moe.routing import route_grouped

                return route_grouped(logits, config.routing, self.e_score_correction_bias)
            return route_grouped_reference(logits, config.routing, self.e_score_correction_bias)
        if launch:
            from gpuworker.kernels.moe.decode import route_top_k

            return route_top_k(logits, config.top_k, config.norm_topk_prob)
        return route_reference(logits, config.top_k, config.norm_topk_prob)

    def kernel_variant(self, num_tokens: int) -> tuple[str, str | int]:
        """Which GPU kernels T tokens take: ("decode", its config name) or ("grouped", its row tile)."""
        from gpuworker.kernels.moe.decode import decode_config
        from gpuworker.kernels.moe.fused import block_m_for

        config = decode_config(num_tokens, self.config.top_k, self.hidden_size, self.config.expert_intermediate_size)
        if config is not None:
            return "decode", config.name
        return "grouped", block_m_for(num_tokens * self.config.top_k, self.num_local_experts)

    def warm_up_token_counts(self, limit: int = 4096) -> list[int]:
        """Token counts, smallest first, at which the GPU path takes each of its kernel variants
        (kernel_variant) for this layer's experts."""
        counts, variants, tokens = [], set(), 1
        while tokens <= limit:
            variant = self.kernel_variant(tokens)
            if variant not in variants:
                variants.add(variant)
                counts.append(tokens)
            tokens *= 2
        return counts

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the GPU kernels once per variant (warm_up_token_counts) on zeros, so that the first
        long prompt does not compile one (about a second on a GPU; the engine's warm-up step is too
        short to reach the prefill tile). The experts alone: no collective, so one rank may run it."""
        if self.block_fp8_experts is not None:
            return  # its kernels compile at their first use
        for tokens in self.warm_up_token_counts():
            self._routed_experts(torch.zeros(tokens, self.hidden_size, dtype=self.w13.dtype, device=self.w13.device))
        if self.parallel is not None and self.parallel.dispatch_experts:
            device = self.w13.device
            for rows in self.dispatched_row_counts():
                ids = torch.full((rows, 1), self.first_expert, dtype=torch.int64, device=device)
                x = torch.zeros(rows, self.hidden_size, dtype=self.w13.dtype, device=device)
                self._experts(x, torch.ones(rows, 1, device=device), ids)

    def dispatched_row_counts(self) -> list[int]:
        """Counts of dispatched choices (one expert each, models.expert_parallel) at which this
        rank's grouped kernels take each of their row tiles (kernels.moe.fused.block_m_for)."""
        return [1, 4 * self.num_local_experts + 1]

    def _routed_experts(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' part of the output for x [T, H]: routed over all experts; on the GPU
        the kernels (kernel_experts), on the CPU the reference."""
        if x.is_cuda and self.block_fp8_experts is None:
            return self.kernel_experts(x)
        return self._experts(x, *self.route(x))

    def kernel_experts(self, x: torch.Tensor) -> torch.Tensor:
        """_routed_experts on the Triton kernels (the GPU path; on the CPU under the interpreter): the
        decode kernels for a few tokens (kernels.moe_decode.decode_config), routed in one launch,
        else the grouped ones, routed in torch."""
        from gpuworker.kernels.moe.decode import decode_config, moe_decode
        from gpuworker.kernels.moe.fused import fused_moe

        w13, w2 = self._expert_weights()
        config = decode_config(x.shape[0], self.config.top_k, self.hidden_size, self.config.expert_intermediate_size)
        if config is not None:
            weights, ids = self.route(x, launch=True)
            return moe_decode(x, w13, w2, weights, ids, self.first_expert, config=config)
        return fused_moe(x, w13, w2, *self.route(x), self.first_expert)

    def _expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts as w13 [E, 2I, H] and w2 [E, H, I]."""
        w13 = self.w13.view(self.num_local_experts, -1, self.hidden_size)
        return w13, self.w2.view(self.num_local_experts, self.hidden_size, -1)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weighted sum over the choices (weights, global ids [T, top_k]) of this rank's experts
        for x [T, H]: the grouped kernels on the GPU, the reference on the CPU (block FP8 experts:
        their own kernels and reference)."""
        if self.block_fp8_experts is not None:
            return self.block_fp8_experts(x, weights, ids, self.first_expert)
        w13, w2 = self._expert_weights()
        if x.is_cuda:
            from gpuworker.kernels.moe.fused import fused_moe

            return fused_moe(x, w13, w2, weights, ids, self.first_expert)
        return experts_reference(x, w13, w2, weights, ids, self.first_expert)

    def _dispatched_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallel by dispatch (models.expert_parallel): this rank routes its slice of the
        tokens, each choice is computed on its expert's rank, and the slice's outputs [t, H] come
        back here."""
        first, held, _ = token_slice(x.shape[0], self.parallel)
        mine = x[first : first + held]
        weights, ids = self.route(mine)
        return dispatch_combine(mine, weights, ids, self._experts, self.num_local_experts, self.parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H], already normalised -> [T, H]."""
        if self.parallel is not None and self.parallel.dispatch_experts:
            return self._forward_dispatched(x)
        out = self._routed_experts(x)
        if self.shared_expert is not None:
            out = out + self._shared(x)
        return out if self.parallel is None else self.parallel.all_reduce(out)

    def _forward_dispatched(self, x: torch.Tensor) -> torch.Tensor:
        """forward under dispatch: the routed outputs of every rank's slice put together; with a
        shared expert (split over the ranks like a dense MLP) each slice is added into this rank's
        shared partial output and one all-reduce joins both, else an all-gather joins the slices."""
        local = self._dispatched_experts(x)
        if self.shared_expert is None:
            return gather_tokens(local, x.shape[0], self.parallel)
        out = self._shared(x)
        first, held, _ = token_slice(x.shape[0], self.parallel)
        out[first : first + held] += local
        return self.parallel.all_reduce(out)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output for x, scaled by its gate where it has one (this rank's slice
        of it, when split)."""
        shared = self.shared_expert.down(self.shared_expert.gate_up_proj(x))
        return shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared
