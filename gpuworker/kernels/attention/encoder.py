"""Bidirectional attention over packed sequences, for encoders (BERT-family embeddings).

The tokens of a batch's sequences lie back to back, without padding: sequence b owns rows
[cu_seqlens[b], cu_seqlens[b+1]) of q, k and v ([T, H, D] each, typically views of one fused QKV
projection), and each of its rows attends to every row of its own sequence and of no other. Packed,
a batch of 256 sentences of 13 to 63 tokens costs the projections its ~9,700 tokens instead of the
~16,000 of a batch padded to its longest, and one launch per layer instead of one per length bucket.

Flash-attention tiling: a program owns BLOCK_M query rows of one head of one sequence and walks that
sequence's keys in BLOCK_N tiles with an online softmax; only the last tile is masked.
`encoder_attention_reference` pads the sequences and calls torch's scaled_dot_product_attention
with the padding masked: the CPU path, and what the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpuworker.kernels.device import online_softmax
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_host_bound,
    check_shape,
    check_tensor,
    dot_options,
    lazy_jit,
    next_power_of_2,
)

_LOG2E = 1.4426950408889634


def _encoder_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_seqlens_ptr,
    out_ptr,
    qk_scale,
    stride_token,
    stride_head,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    m_tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = (tl.load(cu_seqlens_ptr + seq + 1) - start).to(tl.int32)
    if m_tile * BLOCK_M >= length:
        return
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < length
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    head_offset = head * stride_head
    q = tl.load(
        q_ptr + (start + rows)[:, None] * stride_token + head_offset + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        valid = cols < length
        token = (start + cols) * stride_token + head_offset
        k_t = tl.load(k_ptr + token[None, :] + dims[:, None], mask=valid[None, :] & dim_mask[:, None], other=0.0)
        v = tl.load(v_ptr + token[:, None] + dims[None, :], mask=valid[:, None] & dim_mask[None, :], other=0.0)
        scores = online_softmax.dot(q, k_t, DOT_FP32, DOT_PRECISION)
        # Keys past the sequence's end (only in its last tile) are not seen; every row sees key 0.
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        acc, l_i, m_i = online_softmax.step(scores, v, acc, l_i, m_i, DOT_FP32, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


# cu_seqlens and the strides change with every batch: one compiled variant whatever their values.
_encoder_attention = lazy_jit(
    _encoder_attention_kernel, do_not_specialize=("cu_seqlens_ptr", "stride_token", "stride_out_token")
)


def default_tile(dtype: torch.dtype) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps). Half types run on tensor cores; float32 through IEEE FMA dots,
    whose register use limits the tile (encoder heads are small: 32 to 64 dims)."""
    return (32, 32, 4) if dtype == torch.float32 else (64, 64, 4)


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v within each packed sequence -> [T, H, D] (contiguous).

    q, k, v: [T, H, D] of one float dtype and device, each contiguous in D, with the same strides
    (views of one [T, 3, H, D] projection are). cu_seqlens [B + 1] on the same device: 0, then the
    running total of the lengths, ending at T. max_seqlen: a host upper bound on the lengths (sizes
    the grid)."""
    _check(q, k, v, cu_seqlens, max_seqlen)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m, block_n, num_warps = default_tile(q.dtype)
    grid = (triton.cdiv(max_seqlen, block_m), num_heads, num_seqs)
    _encoder_attention[grid](
        q,
        k,
        v,
        cu_seqlens,
        out,
        float(scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **dot_options(q.dtype),
        num_warps=num_warps,
    )
    return out


def _check(q, k, v, cu_seqlens, max_seqlen) -> None:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    for name, tensor in (("k", k), ("v", v)):
        check_tensor(name, tensor, ndim=3, dtypes=(q.dtype,), device=q.device)
        check_shape(name, tensor, tuple(q.shape))
        if tensor.stride() != q.stride():
            raise ValueError(f"{name} must have q's strides {q.stride()}, got {tensor.stride()}")
    if q.shape[-1] > 1 and q.stride(-1) != 1:
        raise ValueError(f"q, k and v must be contiguous in their last dimension, got strides {q.stride()}")
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must hold at least the leading 0")
    check_host_bound("max_seqlen", max_seqlen)


def encoder_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """The same through torch: the sequences padded to max_seqlen, SDPA with the padding masked, and
    the rows packed back."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    num_seqs = lengths.shape[0]
    seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), lengths.long(), output_size=q.shape[0])
    position = torch.arange(q.shape[0], device=q.device) - cu_seqlens[:-1].long()[seq_index]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [B, H, L, D]
        out = x.new_zeros(num_seqs, max_seqlen, *x.shape[1:])
        out[seq_index, position] = x
        return out.transpose(1, 2)

    keep = torch.arange(max_seqlen, device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=keep[:, None, None, :], scale=scale)
    return out.transpose(1, 2)[seq_index, position].contiguous()
