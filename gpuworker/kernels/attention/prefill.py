"""Prefill attention over ragged query chunks that read their keys and values from the paged cache.

Sequence b owns query rows [query_start_loc[b], query_start_loc[b+1]); its context is seq_lens[b]
tokens, the last q_len of which are the new ones (already written to the cache). Query i sits at
absolute position p = seq_len - q_len + i and attends causally to positions 0..p, so a chunk after a
prefix-cache hit or an earlier chunk also sees the cached prefix; with span_ends, a row inside a span
whose tokens attend to each other both ways (Gemma 3's images) sees on to the span's end.
Flash-attention tiling: a program owns BLOCK_M query rows of one head, walks the keys in BLOCK_N
tiles with an online softmax, and only masks the tiles that cross the causal diagonal. An FP8
cache's keys and values are widened to the query's dtype as they are loaded (exact); their scales
multiply the scores and the output (kv_cache_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuworker.kernels.device import online_softmax
from gpuworker.kernels.launch import (
    INDEX_DTYPES,
    check_block_tables,
    check_host_bound,
    check_operand,
    check_query_and_cache,
    check_shape,
    check_tensor,
    dot_options,
    lazy_jit,
    next_power_of_2,
    pdl_options,
)
from gpuworker.kernels.quant.kv_cache import check_kv_scales, dequantize_kv, is_fp8_cache

_LOG2E = 1.4426950408889634


def _prefill_attention_kernel(
    query_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    span_ends_ptr,
    out_ptr,
    qk_scale,
    v_scale,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_tables_seq,
    BLOCK_SIZE: tl.constexpr,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    USE_PDL: tl.constexpr,
    WINDOW: tl.constexpr,
    SPANS: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options: wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Longest tiles (last rows of a causal chunk see the most keys) are launched first, so the short
    # ones fill the tail of the grid instead of leaving a long tile running alone.
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    q_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    kv_head = q_head // QUERY_GROUP

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + (q_start + rows)[:, None] * stride_query_token + q_head * stride_query_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    dtype = query_ptr.dtype.element_ty
    if DOT_FP32:
        q = q.to(tl.float32)
    # Rows past the chunk's end copy the last row's position so no row is fully masked (no NaNs).
    q_pos = prefix_len + tl.minimum(rows, q_len - 1)
    q_end = q_pos  # the last position a row sees: itself, or the end of the span it attends both ways
    if SPANS:
        q_end = tl.load(span_ends_ptr + q_start + tl.minimum(rows, q_len - 1))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    head_base = cache_ptr + kv_head * stride_cache_head

    # Keys every row of the tile sees (strictly before its first query) need no mask; tiles from
    # there up to the last row's position cross the diagonal and do.
    unmasked_end = (prefix_len + m_tile * BLOCK_M) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(seq_len, prefix_len + (m_tile + 1) * BLOCK_M)
    if SPANS:
        kv_end = tl.minimum(seq_len, tl.max(q_end, 0) + 1)
    if WINDOW > 0:
        # A sliding layer: row p sees p - WINDOW < position <= p. Every tile from the first row's
        # window on is masked (both edges); no position before that window is loaded, so the blocks
        # a sliding layer's pool has already dropped from the table are never read.
        masked_begin = tl.maximum(prefix_len + m_tile * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    else:
        for n0 in range(0, unmasked_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            block = tl.load(block_table + pos // BLOCK_SIZE).to(tl.int64)
            row = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_offset
            k_t = tl.load(head_base + row[None, :] + dims[:, None], mask=dim_mask[:, None], other=0.0)
            v = tl.load(head_base + stride_cache_kv + row[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
            if FP8_CACHE:
                k_t = k_t.to(dtype)
                v = v.to(dtype)
            scores = online_softmax.dot(q, k_t, DOT_FP32, DOT_PRECISION)
            scores = scores * qk_scale
            acc, l_i, m_i = online_softmax.step(scores, v, acc, l_i, m_i, DOT_FP32, DOT_PRECISION)
        masked_begin = unmasked_end
    for n0 in range(masked_begin, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        if WINDOW > 0:  # positions before the first row's window are not even loaded
            valid = valid & (pos > prefix_len + m_tile * BLOCK_M - WINDOW)
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_offset
        k_t = tl.load(head_base + row[None, :] + dims[:, None], mask=valid[None, :] & dim_mask[:, None], other=0.0)
        v = tl.load(
            head_base + stride_cache_kv + row[:, None] + dims[None, :],
            mask=valid[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if FP8_CACHE:
            k_t = k_t.to(dtype)
            v = v.to(dtype)
        scores = online_softmax.dot(q, k_t, DOT_FP32, DOT_PRECISION)
        scores = scores * qk_scale
        visible = (pos[None, :] <= q_end[:, None]) & valid[None, :]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
            scores = tl.where(visible, scores, float("-inf"))
            acc, l_i, m_i = online_softmax.step_guarded(scores, v, acc, l_i, m_i, DOT_FP32, DOT_PRECISION)
        else:
            scores = tl.where(visible, scores, float("-inf"))
            acc, l_i, m_i = online_softmax.step(scores, v, acc, l_i, m_i, DOT_FP32, DOT_PRECISION)

    if FP8_CACHE:
        acc = acc * v_scale
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_out_token + q_head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


# Arguments that change from step to step: one compiled variant whatever their alignment or value.
_prefill_attention = lazy_jit(
    _prefill_attention_kernel,
    do_not_specialize=(
        "block_tables_ptr",
        "seq_lens_ptr",
        "query_start_loc_ptr",
        "span_ends_ptr",
        "stride_block_tables_seq",
    ),
)


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    span_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ragged query chunks [T, Hq, D] over their paged contexts -> [T, Hq, D].

    query_start_loc [B + 1] holds row indices into query/out (it need not start at 0, so a slice of
    the step's metadata can address the prefill part of a mixed batch); seq_lens [B] is each
    sequence's context including its new tokens; block_tables [B, max_blocks]. All three stay on the
    device; max_query_len is a host upper bound on the chunk lengths that sizes the grid. Rows of `out`
    outside every chunk are left untouched. k_scale, v_scale: a float8_e4m3fn cache's scales (other
    caches ignore them). window: a sliding-window layer's (0: off): query p attends to the positions
    p - window < position <= p, and the blocks before its first row's window are never read.
    span_ends [T], by row of query: the last position each row attends to, at or past its own (the
    end of a span whose tokens attend to each other both ways, Gemma 3's images; the row's own
    position elsewhere), within its sequence's context. None: every row is causal.
    """
    block_size, num_kv_heads = _checked(query, kv_cache, query_start_loc, seq_lens, block_tables, max_query_len, out)
    if span_ends is not None:
        check_tensor("span_ends", span_ends, ndim=1, dtypes=INDEX_DTYPES, device=query.device)
        check_shape("span_ends", span_ends, (query.shape[0],))
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = seq_lens.shape[0]
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be a non-negative integer (0: off), got {window!r}")
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0 or max_query_len == 0:
        return out

    tile = default_tile(query.dtype, head_dim)
    block_m = tile[0] if block_m is None else block_m
    block_n = tile[1] if block_n is None else block_n
    num_warps = tile[2] if num_warps is None else num_warps
    block_d = next_power_of_2(head_dim)
    fp8 = is_fp8_cache(kv_cache)
    k_scale, v_scale = check_kv_scales(k_scale, v_scale)
    grid = (triton.cdiv(max_query_len, block_m), num_q_heads, num_seqs)
    _prefill_attention[grid](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        seq_lens if span_ends is None else span_ends,  # never read without spans
        out,
        float(scale) * _LOG2E * (k_scale if fp8 else 1.0),
        v_scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        QUERY_GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **dot_options(query.dtype),
        FP8_CACHE=fp8,
        WINDOW=window,
        SPANS=span_ends is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_options(query.device),
    )
    return out


def _checked(query, kv_cache, query_start_loc, seq_lens, block_tables, max_query_len, out) -> tuple[int, int]:
    """Check a call's arguments (see prefill_attention); return the cache's block_size and its number
    of kv heads."""
    block_size, num_kv_heads = check_query_and_cache(query, kv_cache)
    device = query.device
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_seqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_block_tables(block_tables, num_seqs, device, counted_in="seq_lens")
    check_host_bound("max_query_len", max_query_len)
    if out is not None:
        check_operand("out", out, tuple(query.shape), query.dtype, device)
    return block_size, num_kv_heads


def default_tile(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) of a launch on `dtype` heads of `head_dim`.

    bf16/fp16 tiles run on wgmma, where 64x64 tiles on 4 warps ran faster than 128x64 on 8 on Hopper
    (1 x 4096 tokens, bench/kernel_times.py sweep; BENCHMARKS.md, "Figures formerly in code comments").
    float32 ones go through FMA-based IEEE dots, which spill registers beyond 32x16 at head_dim 128
    (Triton's resource report for sm_90); float32 serves exactness checks, not speed.
    """
    if dtype == torch.float32:
        return 32, 16, 8
    return (64, 64, 4) if head_dim <= 128 else (64, 32, 4)


def prefill_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    span_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference: per sequence, gather the context and apply a causal mask offset by the
    prefix (past it up to span_ends where given; with a window, mask the keys at or before p - window)."""
    num_q_heads = query.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query) if out is None else out
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]].float()  # [Lq, Hq, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        first = max(0, seq_len - q_len - window + 1) if window else 0  # the first position any row sees
        positions = torch.arange(first, seq_len, device=query.device)
        blocks = block_tables[i].long()[positions // block_size]
        keys = dequantize_kv(kv_cache[0, blocks, positions % block_size], k_scale).repeat_interleave(group, dim=1)
        values = dequantize_kv(kv_cache[1, blocks, positions % block_size], v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        q_end = q_pos if span_ends is None else span_ends[starts[i] : starts[i + 1]]
        hidden = positions[None, None, :] > q_end[None, :, None]
        if window:
            hidden = hidden | (positions[None, None, :] <= q_pos[None, :, None] - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(query.dtype)
    return out
