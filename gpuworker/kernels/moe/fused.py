"""The experts of a sparse MoE MLP in two grouped GEMM launches, with no host syncs.

Each token's top_k (token, expert) pairs are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M (`align_by_expert`, device ops only, sized for the worst case so the launch grid
is static and a decode step can be captured in a CUDA graph). A program then owns BLOCK_M pairs of
one expert and a column tile: the first kernel computes gate and up for them from w13 [E, 2I, H]
and writes silu(gate) * up [pairs, I] (SiLU-and-mul fused: the [pairs, 2I] product is never
stored); the second multiplies by w2 [E, H, I], scales each row by its routing weight and writes
[pairs, H], which is summed over each token's top_k pairs. Blocks past the last expert's run exit
at once.

Expert parallel: w13 and w2 may hold only a range of the experts (a tensor-parallel rank's share,
from `first_expert`). Routing ids stay global; pairs choosing another rank's expert are grouped in
one more run after this rank's, which the gate/up kernel skips and the down kernel writes as zeros,
so a rank multiplies only its own experts' pairs and the all-reduce after it sums the ranks' parts.

Rounding follows transformers' expert loop: each projection rounded to the activation dtype, silu in
float32, the weighted rows summed per token.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gpuworker.kernels.launch import FLOAT_DTYPES, check_tensor, dot_options, lazy_jit

BLOCK_N = 64
BLOCK_K = 64


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per program: small for decode batches (few pairs per expert, less padding)."""
    return 16 if num_pairs <= 4 * num_experts else 64


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, top_k] -> (pair index per row [P] int32, with T*top_k on padding rows; expert per
    block of block_m rows [P / block_m] int32, num_experts past the last run). Pair p is token
    p // top_k's choice p % top_k. P = T*top_k + num_experts*(block_m - 1), rounded up to block_m."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    rows = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    pair_of_row = torch.full((rows,), num_pairs, dtype=torch.int32, device=ids.device)
    pair_of_row.scatter_(0, ends[expert] - padded[expert] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, rows, block_m, device=ids.device)
    expert_of_block = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return pair_of_row, expert_of_block


def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    out_ptr,
    pair_of_row_ptr,
    expert_of_block_ptr,
    stride_x,
    stride_we,
    stride_wn,
    num_pairs,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + block).to(tl.int64)
    if expert >= NUM_EXPERTS:
        return
    pair = tl.load(pair_of_row_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    token = pair // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < INTER
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w13_ptr + expert * stride_we
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        a = tl.load(x_ptr + token[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w + (INTER + cols)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        if DOT_FP32:  # see launch.dot_options
            a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        gate = tl.dot(a, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    g32 = gate.to(dtype).to(tl.float32)
    activated = (g32 / (1.0 + tl.exp(-g32))).to(dtype)
    out = activated.to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * INTER + cols[None, :], out.to(dtype), mask=valid[:, None] & col_mask[None, :])


def _down_kernel(
    act_ptr,
    w2_ptr,
    weights_ptr,
    out_ptr,
    pair_of_row_ptr,
    expert_of_block_ptr,
    stride_we,
    stride_wn,
    num_pairs,
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + block).to(tl.int64)
    if expert > NUM_EXPERTS:  # past the last run
        return
    pair = tl.load(pair_of_row_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < HIDDEN
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w2_ptr + expert * stride_we
    if expert < NUM_EXPERTS:  # the run of other ranks' experts (== NUM_EXPERTS) keeps 0: they add nothing here
        for k0 in range(0, INTER, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < INTER
            a = tl.load(act_ptr + pair[:, None] * INTER + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(
                w + cols[None, :] * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
            )
            if DOT_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    out = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pair[:, None] * HIDDEN + cols[None, :], out.to(dtype), mask=valid[:, None] & col_mask[None, :])


# The pair count changes with every prefill: not a specialisation key (launch.LazyJIT).
_gate_up = lazy_jit(_gate_up_kernel, do_not_specialize=("num_pairs",))
_down = lazy_jit(_down_kernel, do_not_specialize=("num_pairs",))


def check_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """Check the operands of an experts kernel (fused_moe's, moe_decode's); return (tokens, hidden,
    local experts, expert intermediate size, top_k)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w13", w13, ndim=3, dtypes=(x.dtype,), device=x.device)
    check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,), device=x.device)
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,), device=x.device)
    check_tensor("ids", ids, ndim=2, dtypes=(torch.int64,), device=x.device)
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = ids.shape[1]
    if w13.shape != (num_experts, 2 * inter, hidden) or w2.shape[1] != hidden:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if weights.shape != ids.shape or ids.shape[0] != num_tokens:
        raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [T, top_k]")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 need a contiguous last dimension")
    return num_tokens, hidden, num_experts, inter, top_k


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] of experts
    first_expert..first_expert+E-1; weights [T, top_k] float32; ids [T, top_k] int64 (global
    expert ids) -> [T, H]: the weighted sum of each token's experts among these (see
    models.moe.experts_reference)."""
    num_tokens, hidden, num_experts, inter, top_k = check_experts(x, w13, w2, weights, ids)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    # Choices of experts outside the range form one more run, num_experts, after the local ones.
    local = ids - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    block_m = block_m_for(num_pairs, num_experts)
    pair_of_row, expert_of_block = align_by_expert(local, num_experts + 1, block_m)
    blocks = expert_of_block.numel()
    dots = dot_options(x.dtype)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up[(blocks, -(-inter // BLOCK_N))](
        x,
        w13,
        act,
        pair_of_row,
        expert_of_block,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        num_pairs,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        **dots,
    )
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down[(blocks, -(-hidden // BLOCK_N))](
        act,
        w2,
        weights.contiguous(),
        out,
        pair_of_row,
        expert_of_block,
        w2.stride(0),
        w2.stride(1),
        num_pairs,
        NUM_EXPERTS=num_experts,
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        **dots,
    )
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
