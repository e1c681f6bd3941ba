"""Tensor parallelism inside the model: which shard of each weight a rank holds, and the layers whose
outputs the ranks join with a collective.

A model built with a ParallelContext of world size N holds on each rank: its num_heads / N query
heads and their KV heads (a KV head is replicated on N / num_kv_heads ranks when N exceeds them),
its slice of every MLP's intermediate size, its num_experts / N experts, and its slice of the
vocabulary. Column-parallel projections (qkv_proj, gate_up_proj) are plain Linears of fewer rows;
row-parallel ones (o_proj, down_proj) sum their partial products with an all-reduce; the MoE block
either routes every token over all the experts, computes only the choices of its own (models.moe),
and sums its experts' and shared expert's partial outputs with one all-reduce, or dispatches each
rank's slice of the tokens to the experts' ranks and combines the results back
(models.expert_parallel), as ParallelContext.dispatch_experts says; the embedding is a masked
lookup in the rank's vocabulary rows, then an all-reduce; the logits are the rank's vocabulary
columns, all-gathered. Without a context (N = 1) the model is built exactly as before.

A block-wise FP8 checkpoint splits the same way, each rank taking its rows or columns of a weight
and the matching rows or columns of its block scales, so every shard boundary must fall on a block
boundary; an FP8 checkpoint with a scale per output channel or per tensor splits anywhere
(check_quantized_split). Quantized row-parallel projections join with the same all-reduce
(join_row_parallel). INT4 checkpoints are not split.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from gpuworker.models.config import ModelConfig
from gpuworker.models.layers import GatedMLP, Linear
from gpuworker.models.parallel_context import ParallelContext, join_row_parallel


def active(parallel: ParallelContext | None) -> ParallelContext | None:
    """The context if it splits anything; None for one rank, so N = 1 takes the plain path."""
    return parallel if parallel is not None and parallel.world_size > 1 else None


def kv_head_range(mc: ModelConfig, parallel: ParallelContext) -> tuple[int, int]:
    """(first KV head, count) of this rank: an equal share, or, with more ranks than KV heads, the
    one head its query heads read (each head then on world_size / num_kv_heads ranks)."""
    kv, world = mc.num_kv_heads, parallel.world_size
    if world <= kv:
        return parallel.split(kv, "num_key_value_heads")
    if world % kv:
        raise ValueError(
            f"tensor_parallel_size ({world}) must divide num_key_value_heads ({kv}) or be a multiple of it"
        )
    return parallel.rank // (world // kv), 1


def vocab_range(vocab_size: int, parallel: ParallelContext) -> tuple[int, int, int]:
    """(first token, tokens held, rows allocated) of this rank's vocabulary slice: every rank
    allocates ceil(vocab_size / N) rows so the logits gather in equal parts; the last rank's
    slice may hold fewer tokens."""
    rows = -(-vocab_size // parallel.world_size)
    first = parallel.rank * rows
    return first, max(0, min(rows, vocab_size - first)), rows


def shard_config(mc: ModelConfig, parallel: ParallelContext | None) -> ModelConfig:
    """The shapes one rank holds: its query and KV heads and its share of the dense MLP (the KV
    cache and the memory sizing read these); `mc` itself for one rank. ValueError naming the field
    when the model does not split into world_size ranks."""
    parallel = active(parallel)
    if parallel is None:
        return mc
    _, heads = parallel.split(mc.num_heads, "num_attention_heads")
    _, kv_heads = kv_head_range(mc, parallel)
    moe = mc.moe
    dense_layers = moe is None or not all(moe.sparse_layers)
    intermediate = (
        parallel.split(mc.intermediate_size, "intermediate_size")[1] if dense_layers else mc.intermediate_size
    )
    if moe is not None:
        parallel.split(moe.num_experts, "num_experts")
        if moe.shared_expert_intermediate_size:
            parallel.split(moe.shared_expert_intermediate_size, "shared_expert_intermediate_size")
    local = replace(mc, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=intermediate)
    if mc.quantization is not None:
        check_quantized_split(mc, local, parallel)
    return local


def check_quantized_split(mc: ModelConfig, local: ModelConfig, parallel: ParallelContext) -> None:
    """ValueError unless mc's quantization splits over the ranks. FP8 with a scale per output channel
    or per tensor splits anywhere (a rank's rows take their channels' scales, its columns all of
    them); block-wise FP8 where each rank's rows (column-parallel projections) and input columns
    (row-parallel ones) are whole blocks of weight_block_size, so its scales are the blocks it holds;
    INT4 (AWQ, GPTQ) not at all."""
    quant, world = mc.quantization, parallel.world_size
    if quant.method != "fp8":
        raise ValueError(
            f"quantization: a {quant.label} model ({quant.checkpoint_format}) cannot be split over "
            f"tensor_parallel_size ({world}) ranks: its INT4 weights are packed and scaled per group of "
            f"input columns, which are not sharded; only FP8 checkpoints split. Serve it with tensor_parallel_size 1"
        )
    if quant.weight_strategy != "block":
        return
    rows, columns = quant.weight_block_size
    moe = mc.moe
    # (field, the checkpoint's size, this rank's share, the block dimension it must be whole blocks of)
    splits: list[tuple[str, int, int, int]] = []
    if mc.mla is None:
        splits += [
            ("num_attention_heads * head_dim", mc.q_size, local.q_size, math.lcm(rows, columns)),
            ("num_key_value_heads * head_dim", mc.kv_size, local.kv_size, rows),
        ]
    else:
        mla, heads = mc.mla, local.num_heads
        splits += [
            ("num_attention_heads * qk_head_dim", mc.num_heads * mla.qk_head_dim, heads * mla.qk_head_dim, rows),
            (
                "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
                mc.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                rows,
            ),
            ("num_attention_heads * v_head_dim", mc.num_heads * mla.v_head_dim, heads * mla.v_head_dim, columns),
        ]
    if local.intermediate_size != mc.intermediate_size:
        splits.append(("intermediate_size", mc.intermediate_size, local.intermediate_size, math.lcm(rows, columns)))
    if moe is not None and moe.shared_expert_intermediate_size:
        shared = moe.shared_expert_intermediate_size
        splits.append(("shared_expert_intermediate_size", shared, shared // world, math.lcm(rows, columns)))
    for field, size, share, block in splits:
        if share % block:
            raise ValueError(
                f"quantization: {field} ({size}) split over tensor_parallel_size ({world}) gives {share} per rank, "
                f"not a multiple of the weight_block_size {list(quant.weight_block_size)} blocks ({block}): each "
                f"rank must hold whole blocks of the block scales"
            )


class RowParallelLinear(Linear):
    """A linear whose input features are split across the ranks: each rank multiplies its slice,
    an all-reduce sums the partial products, and the bias (whole on every rank) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return join_row_parallel(F.linear(x, self.weight), self.bias, self.parallel)


class ParallelGatedMLP(GatedMLP):
    """GatedMLP over this rank's slice of the intermediate size (gate_up_proj column-parallel,
    down_proj row-parallel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, parallel: ParallelContext) -> None:
        super().__init__(hidden_size, intermediate_size, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, parallel)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        # Not GatedMLP's fused GEMV: that applies the bias before the partial sums are joined.
        if gate_up.is_cuda:
            from gpuworker.kernels.linear.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def vocab_parallel_embedding(
    weight: torch.Tensor, input_ids: torch.Tensor, vocab_size: int, parallel: ParallelContext
) -> torch.Tensor:
    """Rows of this rank's vocabulary slice `weight` for the ids it holds, zeros for the others,
    summed over the ranks: every id's embedding, from the one rank that holds it."""
    first, held, _ = vocab_range(vocab_size, parallel)
    local = input_ids - first
    mine = (local >= 0) & (local < held)
    hidden = weight[torch.where(mine, local, 0)]
    return parallel.all_reduce(torch.where(mine[:, None], hidden, 0))


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, parallel: ParallelContext
) -> torch.Tensor:
    """hidden [N, H] -> the full logits [N, vocab_size] in float32: this rank's vocabulary columns,
    gathered from every rank (the padding rows of the last slice cut off)."""
    local = F.linear(hidden, weight).float()
    return torch.cat(parallel.all_gather(local), dim=-1)[:, :vocab_size]
