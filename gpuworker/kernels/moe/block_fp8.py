"""The experts of a sparse MoE MLP with block-wise FP8 weights (DeepSeek's routed experts), in two
grouped GEMM launches with no host syncs: kernels.moe.fused's scheme with FP8 operands.

Each expert's gate, up and down projections are float8_e4m3fn with one float32 scale per block of
[group_n, group_k] (the checkpoint's weight_scale_inv): w13 [E, 2I, H] with w13_scale [E, 2 *
ceil(I / group_n), ceil(H / group_k)] (gate's block rows, then up's, so neither shares a block with
the other), w2 [E, H, I] with w2_scale [E, ceil(H / group_n), ceil(I / group_k)]. The tokens are
quantized per token and group of group_k columns before the first launch, the SiLU-and-mul output per
pair and group before the second (as DeepSeek's MoE quantizes each projection's input); each K step
is one column group, scaled by its activation and weight scales into a float32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuworker.kernels.launch import FLOAT_DTYPES, check_operand, check_tensor, interpreting, lazy_jit
from gpuworker.kernels.moe.fused import align_by_expert, block_m_for
from gpuworker.kernels.quant.block_fp8_matmul import dequantize_block_fp8, quantize_fp8_groups
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE

BLOCK_N = 64


@triton.jit
def _scaled_dot(acc, a, a_scale, b, b_scale, DOT_FP32: tl.constexpr):
    """acc + (a @ b) * a_scale[:, None] * b_scale[None, :], the product of one column group."""
    if DOT_FP32:  # the interpreter: products in float32
        part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(a, b)
    return acc + part * a_scale[:, None] * b_scale[None, :]


def _gate_up_kernel(
    x_ptr,
    x_scale_ptr,
    w13_ptr,
    w13_scale_ptr,
    out_ptr,
    pair_of_row_ptr,
    expert_of_block_ptr,
    stride_x,
    stride_xs,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    num_pairs,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    GROUP_N: tl.constexpr,
    UP_SCALE_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    gate_scales = w13_scale_ptr + expert * stride_se + (cols // GROUP_N) * stride_sn
    up_scales = gate_scales + UP_SCALE_ROW * stride_sn
    for kb in range(0, tl.cdiv(HIDDEN, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        a = tl.load(x_ptr + token[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        a_scale = tl.load(x_scale_ptr + token * stride_xs + kb, mask=valid, other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w + (INTER + cols)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        gate_scale = tl.load(gate_scales + kb, mask=col_mask, other=0.0)
        up_scale = tl.load(up_scales + kb, mask=col_mask, other=0.0)
        gate = _scaled_dot(gate, a, a_scale, w_gate, gate_scale, DOT_FP32)
        up = _scaled_dot(up, a, a_scale, w_up, up_scale, DOT_FP32)
    # Rounded as kernels.moe.fused rounds: each projection to the activation dtype, silu in float32.
    dtype = out_ptr.dtype.element_ty
    g32 = gate.to(dtype).to(tl.float32)
    activated = (g32 / (1.0 + tl.exp(-g32))).to(dtype)
    out = activated.to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * INTER + cols[None, :], out.to(dtype), mask=valid[:, None] & col_mask[None, :])


def _down_kernel(
    act_ptr,
    act_scale_ptr,
    w2_ptr,
    w2_scale_ptr,
    weights_ptr,
    out_ptr,
    pair_of_row_ptr,
    expert_of_block_ptr,
    stride_as,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    num_pairs,
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    scales = w2_scale_ptr + expert * stride_se + (cols // GROUP_N) * stride_sn
    if expert < NUM_EXPERTS:  # the run of other ranks' experts (== NUM_EXPERTS) keeps 0: they add nothing here
        for kb in range(0, tl.cdiv(INTER, BLOCK_K)):
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = ks < INTER
            a = tl.load(act_ptr + pair[:, None] * INTER + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
            a_scale = tl.load(act_scale_ptr + pair * stride_as + kb, mask=valid, other=0.0)
            b = tl.load(
                w + cols[None, :] * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
            )
            b_scale = tl.load(scales + kb, mask=col_mask, other=0.0)
            acc = _scaled_dot(acc, a, a_scale, b, b_scale, DOT_FP32)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    out = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pair[:, None] * HIDDEN + cols[None, :], out.to(dtype), mask=valid[:, None] & col_mask[None, :])


_gate_up = lazy_jit(_gate_up_kernel, do_not_specialize=("num_pairs",))
_down = lazy_jit(_down_kernel, do_not_specialize=("num_pairs",))


def check_block_fp8_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: tuple[int, int],
) -> tuple[int, int, int, int]:
    """Check the operands; return (local experts, hidden, expert intermediate size, top_k)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w13", w13, ndim=3, dtypes=(FP8_DTYPE,), device=x.device)
    check_tensor("w2", w2, ndim=3, dtypes=(FP8_DTYPE,), device=x.device)
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,), device=x.device)
    check_tensor("ids", ids, ndim=2, dtypes=(torch.int64,), device=x.device)
    group_n, group_k = block
    if group_k < 16 or group_k & (group_k - 1) or group_n < 1:
        raise ValueError(f"block must be [rows >= 1, columns a power of two >= 16], got {list(block)}")
    hidden = x.shape[1]
    num_experts, inter = w2.shape[0], w2.shape[2]
    if w13.shape != (num_experts, 2 * inter, hidden) or w2.shape[1] != hidden:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    inter_blocks, hidden_blocks = -(-inter // group_n), -(-hidden // group_n)
    check_operand(
        "w13_scale", w13_scale, (num_experts, 2 * inter_blocks, -(-hidden // group_k)), torch.float32, x.device
    )
    check_operand("w2_scale", w2_scale, (num_experts, hidden_blocks, -(-inter // group_k)), torch.float32, x.device)
    if weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [T, top_k]")
    if w13.stride(2) != 1 or w2.stride(2) != 1 or w13_scale.stride(2) != 1 or w2_scale.stride(2) != 1:
        raise ValueError("w13, w2 and their scales need a contiguous last dimension")
    return num_experts, hidden, inter, ids.shape[1]


def fused_moe_block_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: tuple[int, int],
    first_expert: int = 0,
) -> torch.Tensor:
    """x [T, H]; block FP8 experts first_expert..first_expert+E-1 (w13, w2 and their scales, see the
    module); weights [T, top_k] float32; ids [T, top_k] int64 (global expert ids) -> [T, H] in x's
    dtype: the weighted sum of each token's experts among these (experts_block_fp8_reference)."""
    num_experts, hidden, inter, top_k = check_block_fp8_experts(x, w13, w13_scale, w2, w2_scale, weights, ids, block)
    num_tokens = x.shape[0]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    group_n, group_k = block
    x_q, x_scale = quantize_fp8_groups(x.contiguous(), group_k, use_kernel=True)
    local = ids - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    block_m = block_m_for(num_pairs, num_experts)
    pair_of_row, expert_of_block = align_by_expert(local, num_experts + 1, block_m)
    blocks = expert_of_block.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    shapes = {"BLOCK_M": block_m, "BLOCK_N": BLOCK_N, "BLOCK_K": group_k, "DOT_FP32": interpreting(), "num_warps": 4}
    _gate_up[(blocks, triton.cdiv(inter, BLOCK_N))](
        x_q,
        x_scale,
        w13,
        w13_scale,
        act,
        pair_of_row,
        expert_of_block,
        x_q.stride(0),
        x_scale.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        num_pairs,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        HIDDEN=hidden,
        INTER=inter,
        GROUP_N=group_n,
        UP_SCALE_ROW=-(-inter // group_n),
        **shapes,
    )
    act_q, act_scale = quantize_fp8_groups(act, group_k, use_kernel=True)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down[(blocks, triton.cdiv(hidden, BLOCK_N))](
        act_q,
        act_scale,
        w2,
        w2_scale,
        weights.contiguous(),
        out,
        pair_of_row,
        expert_of_block,
        act_scale.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        num_pairs,
        NUM_EXPERTS=num_experts,
        HIDDEN=hidden,
        INTER=inter,
        GROUP_N=group_n,
        **shapes,
    )
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


def _fake_quantized(x: torch.Tensor, group_k: int) -> torch.Tensor:
    """x rounded through FP8 per row and group of group_k columns, as float32."""
    q, scale = quantize_fp8_groups(x, group_k, use_kernel=False)
    return dequantize_block_fp8(q, scale, 1, group_k)


def experts_block_fp8_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: tuple[int, int],
    first_expert: int = 0,
) -> torch.Tensor:
    """fused_moe_block_fp8 in torch ops, densely (every expert on every token, weighted 0 where not
    chosen, as models.moe.experts_reference): weights dequantised per call, each projection's input
    rounded through FP8 per token and column group, each projection rounded to x's dtype."""
    group_n, group_k = block
    inter = w2.shape[2]
    up_row = -(-inter // group_n)
    x_f = _fake_quantized(x, group_k)
    out = torch.zeros_like(x)
    for local in range(w13.shape[0]):
        weight = torch.where(ids == first_expert + local, weights, 0.0).sum(dim=-1, keepdim=True)
        gate_w = dequantize_block_fp8(w13[local, :inter], w13_scale[local, :up_row], group_n, group_k)
        up_w = dequantize_block_fp8(w13[local, inter:], w13_scale[local, up_row:], group_n, group_k)
        gate = torch.nn.functional.linear(x_f, gate_w).to(x.dtype).float()
        up = torch.nn.functional.linear(x_f, up_w).to(x.dtype).float()
        act = (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)
        down_w = dequantize_block_fp8(w2[local], w2_scale[local], group_n, group_k)
        down = torch.nn.functional.linear(_fake_quantized(act, group_k), down_w).to(x.dtype)
        out += (down.float() * weight).to(x.dtype)
    return out
