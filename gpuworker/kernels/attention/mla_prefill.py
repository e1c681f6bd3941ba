"""Prefill attention of multi-head latent attention (DeepSeek-V2/V3) over expanded keys and values.

A prefill step expands the cached latents of all its sequences at once (one gather, one kv_b_proj
GEMM), so each sequence's keys and values lie back to back: sequence b owns query rows
[cu_seqlens_q[b], cu_seqlens_q[b+1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b+1]). Its queries
are the LAST q_len of its seq_len context positions (a chunk after earlier chunks or a prefix-cache
hit), so query i sits at position seq_len - q_len + i and attends causally to positions 0..that.

A key is per head in its first part (k_nope [S, H, nope], from kv_b_proj) and shared by the heads in
its rotary part (k_rope, [S, rope] broadcast over the heads with a head stride of 0), so the kernel
takes the two parts apart and never materialises [S, H, nope + rope]; the score is
q_nope . k_nope + q_rope . k_rope. The value head dim (v_dim) differs from the key's (nope + rope).

Flash-attention tiling: a program owns BLOCK_M query rows of one head of one sequence, walks the
keys in BLOCK_N tiles with an online softmax in float32 (log2 units), and masks only the tiles that
cross the causal diagonal. `mla_prefill_attention_reference` is the float32 torch twin (the CPU path
and what the kernel is tested against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpuworker.kernels import configs
from gpuworker.kernels.device import online_softmax
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_host_bound,
    check_tensor,
    dot_options,
    lazy_jit,
    next_power_of_2,
)

KERNEL = "mla_prefill"
TABLE_KEY = ("dtype", "nope_dim", "rope_dim", "v_dim")
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLAPrefillConfig:
    block_m: int = 64  # query rows per program
    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_CONFIG = MLAPrefillConfig()
# float32 goes through IEEE FMA dots, whose registers limit the tile; it serves exactness, not speed.
FLOAT32_CONFIG = MLAPrefillConfig(block_m=32, block_n=16, num_warps=8)


def tuned_config(
    dtype: torch.dtype, nope_dim: int, rope_dim: int, v_dim: int, device: torch.device
) -> MLAPrefillConfig:
    """The device's measured tile for this shape (configs/mla_prefill/<GPU>.json), else the default."""
    if dtype == torch.float32:
        return FLOAT32_CONFIG
    name = str(dtype).removeprefix("torch.")
    table = configs.table(KERNEL, TABLE_KEY, device, build=MLAPrefillConfig)
    return table.get((name, nope_dim, rope_dim, v_dim), DEFAULT_CONFIG)


@triton.jit
def _scores(
    q_nope,
    q_rope,
    k_nope_ptr,
    k_rope_ptr,
    k_nope_rows,
    k_rope_rows,
    valid,
    nope,
    rope,
    nope_ok,
    rope_ok,
    qk_scale,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[M, N] scores (log2 units) of the tile's keys at row offsets k_*_rows (valid [N])."""
    k_nope_t = tl.load(
        k_nope_ptr + k_nope_rows[None, :] + nope[:, None], mask=valid[None, :] & nope_ok[:, None], other=0.0
    )
    k_rope_t = tl.load(
        k_rope_ptr + k_rope_rows[None, :] + rope[:, None], mask=valid[None, :] & rope_ok[:, None], other=0.0
    )
    scores = online_softmax.dot(q_nope, k_nope_t, DOT_FP32, DOT_PRECISION)
    scores += online_softmax.dot(q_rope, k_rope_t, DOT_FP32, DOT_PRECISION)
    return scores * qk_scale


def _mla_prefill_kernel(
    q_nope_ptr,
    q_rope_ptr,
    k_nope_ptr,
    k_rope_ptr,
    v_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    out_ptr,
    qk_scale,
    stride_q_nope_token,
    stride_q_nope_head,
    stride_q_rope_token,
    stride_q_rope_head,
    stride_k_nope_token,
    stride_k_nope_head,
    stride_k_rope_token,
    stride_k_rope_head,
    stride_v_token,
    stride_v_head,
    stride_out_token,
    stride_out_head,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Longest tiles (a causal chunk's last rows see the most keys) are launched first.
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_q_ptr + seq + 1) - q_start).to(tl.int32)
    if m_tile * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq).to(tl.int64)
    seq_len = (tl.load(cu_seqlens_k_ptr + seq + 1) - k_start).to(tl.int32)
    prefix_len = seq_len - q_len

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    nope = tl.arange(0, BLOCK_NOPE)
    rope = tl.arange(0, BLOCK_ROPE)
    dims_v = tl.arange(0, BLOCK_V)
    nope_ok = nope < NOPE
    rope_ok = rope < ROPE
    v_ok = dims_v < V_DIM
    q_token = q_start + rows
    q_nope = tl.load(
        q_nope_ptr + q_token[:, None] * stride_q_nope_token + head * stride_q_nope_head + nope[None, :],
        mask=row_mask[:, None] & nope_ok[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr + q_token[:, None] * stride_q_rope_token + head * stride_q_rope_head + rope[None, :],
        mask=row_mask[:, None] & rope_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q_nope = q_nope.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    # Rows past the chunk's end copy the last row's position so no row is fully masked (no NaNs).
    q_pos = prefix_len + tl.minimum(rows, q_len - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    k_nope_base = k_nope_ptr + head * stride_k_nope_head
    k_rope_base = k_rope_ptr + head * stride_k_rope_head
    v_base = v_ptr + head * stride_v_head

    # Keys every row of the tile sees need no mask; the tiles up to the last row's position do.
    unmasked_end = (prefix_len + m_tile * BLOCK_M) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(seq_len, prefix_len + (m_tile + 1) * BLOCK_M)
    for n0 in range(0, unmasked_end, BLOCK_N):
        token = k_start + n0 + tl.arange(0, BLOCK_N)
        everywhere = tl.full([BLOCK_N], 1, tl.int1)
        scores = _scores(
            q_nope,
            q_rope,
            k_nope_base,
            k_rope_base,
            token * stride_k_nope_token,
            token * stride_k_rope_token,
            everywhere,
            nope,
            rope,
            nope_ok,
            rope_ok,
            qk_scale,
            DOT_FP32,
            DOT_PRECISION,
        )
        v = tl.load(v_base + (token * stride_v_token)[:, None] + dims_v[None, :], mask=v_ok[None, :], other=0.0)
        acc, l_i, m_i = online_softmax.step(scores, v, acc, l_i, m_i, DOT_FP32, DOT_PRECISION)
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        token = k_start + pos
        scores = _scores(
            q_nope,
            q_rope,
            k_nope_base,
            k_rope_base,
            token * stride_k_nope_token,
            token * stride_k_rope_token,
            valid,
            nope,
            rope,
            nope_ok,
            rope_ok,
            qk_scale,
            DOT_FP32,
            DOT_PRECISION,
        )
        v = tl.load(
            v_base + (token * stride_v_token)[:, None] + dims_v[None, :],
            mask=valid[:, None] & v_ok[None, :],
            other=0.0,
        )
        visible = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        acc, l_i, m_i = online_softmax.step(scores, v, acc, l_i, m_i, DOT_FP32, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_token[:, None] * stride_out_token + head * stride_out_head + dims_v[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & v_ok[None, :],
    )


# The cumulative lengths are slices of the step's metadata, whose alignment changes from step to
# step: one compiled variant whatever it is. The strides are the model's (heads times head dims), so
# they stay specialised: known multiples of 16, the tiles' loads are vectorised.
_mla_prefill = lazy_jit(_mla_prefill_kernel, do_not_specialize=("cu_seqlens_q_ptr", "cu_seqlens_k_ptr"))


def mla_prefill_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    config: MLAPrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of ragged query chunks over their sequences' expanded keys -> [T, H, v_dim].

    q_nope [T, H, nope], q_rope [T, H, rope]: the queries' two parts; k_nope [S, H, nope], k_rope
    [S, H, rope] (an expanded [S, 1, rope] view shares it over the heads), v [S, H, v_dim]; one float
    dtype and device, each contiguous in its last dim. cu_seqlens_q [B + 1]: row indices into the
    queries and `out` (they need not start at 0, so a slice of a step's query_start_loc can address
    the prefill part of a mixed batch); cu_seqlens_k [B + 1]: into the keys, each sequence's context
    at least as long as its chunk. max_query_len: a host bound on the chunk lengths (sizes the grid).
    Rows of `out` outside every chunk are left untouched."""
    _check(q_nope, q_rope, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_query_len, out)
    num_heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    rope_dim, v_dim = q_rope.shape[2], v.shape[2]
    if out is None:
        out = torch.empty(q_nope.shape[0], num_heads, v_dim, dtype=q_nope.dtype, device=q_nope.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs == 0 or max_query_len == 0:
        return out
    config = config or tuned_config(q_nope.dtype, nope_dim, rope_dim, v_dim, q_nope.device)
    grid = (triton.cdiv(max_query_len, config.block_m), num_heads, num_seqs)
    _mla_prefill[grid](
        q_nope,
        q_rope,
        k_nope,
        k_rope,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        out,
        float(scale) * _LOG2E,
        q_nope.stride(0),
        q_nope.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_rope.stride(0),
        k_rope.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        NOPE=nope_dim,
        ROPE=rope_dim,
        V_DIM=v_dim,
        BLOCK_NOPE=max(16, next_power_of_2(nope_dim)),
        BLOCK_ROPE=max(16, next_power_of_2(rope_dim)),
        BLOCK_V=max(16, next_power_of_2(v_dim)),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        **dot_options(q_nope.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _check(q_nope, q_rope, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_query_len, out) -> None:
    check_tensor("q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES)
    dtype, device = q_nope.dtype, q_nope.device
    for name, tensor in (("q_rope", q_rope), ("k_nope", k_nope), ("k_rope", k_rope), ("v", v)):
        check_tensor(name, tensor, ndim=3, dtypes=(dtype,), device=device)
    num_tokens, num_heads = q_nope.shape[:2]
    context = k_nope.shape[0]
    expected = {
        "q_rope": (num_tokens, num_heads, q_rope.shape[2]),
        "k_nope": (context, num_heads, q_nope.shape[2]),
        "k_rope": (context, num_heads, q_rope.shape[2]),
        "v": (context, num_heads, v.shape[2]),
    }
    for name, tensor in (("q_rope", q_rope), ("k_nope", k_nope), ("k_rope", k_rope), ("v", v)):
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{name} must have shape {expected[name]}, got {tuple(tensor.shape)}")
    for name, tensor in (("q_nope", q_nope), ("q_rope", q_rope), ("k_nope", k_nope), ("k_rope", k_rope), ("v", v)):
        if tensor.shape[2] < 1:
            raise ValueError(f"{name} needs a head dim of at least 1, got shape {tuple(tensor.shape)}")
        if tensor.shape[2] > 1 and tensor.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}")
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, tensor, ndim=1, dtypes=INDEX_DTYPES, device=device)
        if tensor.shape[0] < 1:
            raise ValueError(f"{name} must hold at least one offset, got shape {tuple(tensor.shape)}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
            "must count the same sequences"
        )
    check_host_bound("max_query_len", max_query_len)
    if out is not None:
        shape = (num_tokens, num_heads, v.shape[2])
        check_tensor("out", out, ndim=3, dtypes=(dtype,), device=device)
        if tuple(out.shape) != shape or out.stride(2) != 1:
            raise ValueError(f"out must be a {shape} tensor contiguous in its last dim, got {tuple(out.shape)}")


def mla_prefill_attention_reference(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in float32 torch, one sequence at a time (the cumulative lengths on the
    host); rounded to the queries' dtype at the end."""
    if out is None:
        out = torch.zeros(q_nope.shape[0], q_nope.shape[1], v.shape[2], dtype=q_nope.dtype, device=q_nope.device)
    for b in range(len(cu_seqlens_q) - 1):
        q_begin, q_end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        k_begin, k_end = cu_seqlens_k[b], cu_seqlens_k[b + 1]
        if q_end == q_begin:
            continue
        query = torch.cat((q_nope[q_begin:q_end], q_rope[q_begin:q_end]), dim=-1).float()
        keys = torch.cat((k_nope[k_begin:k_end], k_rope[k_begin:k_end]), dim=-1).float()
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        q_pos = torch.arange(k_end - k_begin - (q_end - q_begin), k_end - k_begin, device=query.device)
        hidden = torch.arange(k_end - k_begin, device=query.device)[None, None, :] > q_pos[None, :, None]
        weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", weights, v[k_begin:k_end].float()).to(out.dtype)
    return out
