"""Paged decode attention: one new query token per sequence attends to its whole cached context.

Grouped-query aware: a program owns one kv head of one sequence and all the query heads that share
it, so each K/V row is read from memory once per group. Split along the sequence (flash-decoding):
when batch x kv heads is too small to fill the GPU, the context is cut into partitions processed in
parallel. Large batches merge the partial softmaxes in the same launch, by whichever partition of a
(sequence, kv head) finishes last (an arrival counter per pair, reset by that program; a sequence
whose context fits one partition writes its output directly); small ones, where that costs more
than a second launch, store their partials and merge them in a second small kernel. Everything the
launch shape depends on is a host integer (max_seq_len), never a device value, so the call can be
captured in a CUDA graph, and a graph captured for long contexts costs one or two launches per
layer, however short the contexts it replays with.

Given the step's own tokens (NewTokens), the launch also does what the rotary kernel would do
before it: it rotates the query and the new key, stores the key and value in the cache, and
attends to that token from registers (the engine's decode rows: one launch per layer fewer). That
work is device/rotary_cache.py's, whose rules the rotary kernel shares; DecodeVariant says which of
these features a launch has and turns them into the kernel's constexprs.

An FP8 cache (kv_cache_quant.py) is widened as it is loaded (exact): to float16 for half-precision
queries (one instruction per two values; the dots then run in float16), to float32 for float32
ones; the key scale multiplies the scores and the value scale the output. The new token is quantized as the
cache stores it before it is attended to, so it counts as every other cached token does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpuworker.kernels import configs
from gpuworker.kernels.attention.kv_cache_write import check_kv_cache_write
from gpuworker.kernels.attention.rotary import apply_rotary_and_cache_reference, check_rotary
from gpuworker.kernels.device import online_softmax, rotary_cache
from gpuworker.kernels.launch import (
    INDEX_DTYPES,
    check_block_tables,
    check_contiguous,
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
from gpuworker.kernels.norm.qk_norm import QKNorm, check_qk_norm
from gpuworker.kernels.quant.kv_cache import check_kv_scales, dequantize_kv, is_fp8_cache

_LOG2E = 1.4426950408889634
# Most splits a launch uses; the merging program reads all of a head's partials in one tile.
MAX_SPLITS = 64
# Shortest partition worth its own program (one 64-token tile).
MIN_PARTITION = 64
# Programs per multiprocessor to aim for, from bench/kernel_times.py's split sweeps on Hopper (Llama-3-8B
# heads): a batch too small to fill the device wants many short partitions, while one that nearly
# fills it wants few (BENCHMARKS.md, "Figures formerly in code comments").
_WAVES_SMALL_BATCH = 4
_WAVES = 2


def _paged_decode_kernel(
    query_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counters_ptr,
    positions_ptr,
    key_ptr,
    value_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    norm_eps,
    qk_scale,
    k_scale,
    v_scale,
    stride_query_seq,
    stride_query_head,
    stride_out_seq,
    stride_out_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_tables_seq,
    stride_key_seq,
    stride_key_head,
    stride_value_seq,
    stride_value_head,
    stride_cos,
    stride_sin,
    partition_size,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    QUERY_GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE_IN_LAUNCH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NEW_TOKEN: tl.constexpr,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    FP8_V_PAIRS: tl.constexpr,
    USE_PDL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    # The constexprs come from DecodeVariant.constexprs (see there for what each switch does).
    if USE_PDL:  # see launch.pdl_options. The next kernel may launch at once: at batch 1 it is
        # the merge or the o_proj GEMV, whose programs then load their first weight tiles while this
        # latency-bound kernel runs (gemv's prefetch); their wait still orders them after us.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_q_heads = num_kv_heads * QUERY_GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_begin, ctx_len = _window_context(seq_len, WINDOW)
    if SPLIT and not MERGE_IN_LAUNCH:
        partition_size, num_parts = _sequence_partitions(ctx_len, num_splits, BLOCK_N)
    else:
        # Partitions holding tokens: at least one, which writes the zeros of a padded row (seq_len 0).
        # The grid covers max_seq_len, so in a graph captured for long contexts most of them are
        # empty.
        num_parts = tl.minimum(tl.maximum((ctx_len + partition_size - 1) // partition_size, 1), num_splits)
    if SPLIT:  # without splits the one partition always holds the context (or a padded row's zeros)
        if split >= num_parts:
            # A partition past this sequence's context (in a graph captured for long contexts, most
            # of them) stores nothing, so it leaves before loading anything more. Only split launches
            # have such partitions; the others keep a single-block kernel (the compiler's view of
            # the loop unchanged where large batches spend their time).
            return
    start = split * partition_size
    if WINDOW > 0:
        start += ctx_begin
    if NEW_TOKEN:  # the step's own token is not in the cache yet: the cache holds seq_len - 1
        end = tl.minimum(start + partition_size, tl.maximum(seq_len - 1, 0))
    else:
        end = tl.minimum(start + partition_size, seq_len)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    q_heads = kv_head * QUERY_GROUP + group
    group_mask = group < QUERY_GROUP
    dim_mask = dims < HEAD_DIM
    q_ptrs = query_ptr + seq * stride_query_seq + q_heads[:, None] * stride_query_head
    q = tl.load(q_ptrs + dims[None, :], mask=group_mask[:, None] & dim_mask[None, :], other=0.0)
    if NEW_TOKEN:
        # Rotary (after each head's norm with QK_NORM) as kernels/rotary.py computes it, in
        # registers: the query, and the key of this (sequence, kv head), which the partition
        # holding the last position attends to and stores, with the value.
        position = tl.load(positions_ptr + seq).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        q, k_new, v_new = rotary_cache.decode_token(
            q,
            q_ptrs,
            group_mask,
            dims,
            dim_mask,
            position,
            seq,
            kv_head,
            key_ptr,
            stride_key_seq,
            stride_key_head,
            value_ptr,
            stride_value_seq,
            stride_value_head,
            cos_ptr,
            sin_ptr,
            stride_cos,
            stride_sin,
            q_norm_ptr,
            k_norm_ptr,
            norm_eps,
            k_scale,
            v_scale,
            cache_ptr.dtype.element_ty,
            HALF,
            HEAD_DIM,
            QK_NORM,
            FP8_CACHE,
        )

    # In this order: Triton orders the results of the `if` below by when their names were first
    # defined, and the compiled code's registers follow (another order renumbers them).
    m_i, l_i, acc = _attend_cached(
        q,
        seq,
        kv_head,
        start,
        end,
        dims,
        dim_mask,
        block_tables_ptr,
        stride_block_tables_seq,
        cache_ptr,
        stride_cache_kv,
        stride_cache_block,
        stride_cache_offset,
        stride_cache_head,
        qk_scale,
        GROUP_PAD,
        BLOCK_D,
        BLOCK_N,
        BLOCK_SIZE,
        FP8_CACHE,
        FP8_AS_F16,
        FP8_V_PAIRS,
        DOT_FP32,
        DOT_PRECISION,
    )

    if NEW_TOKEN:
        if (split == num_parts - 1) & (seq_len > 0):  # the partition holding the last position
            rotary_cache.cache_decode_token(
                cache_ptr,
                slot,
                kv_head,
                dims,
                dim_mask,
                k_new,
                v_new,
                stride_cache_kv,
                stride_cache_block,
                stride_cache_offset,
                stride_cache_head,
                BLOCK_SIZE,
            )
            score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
            acc, l_i, m_i = online_softmax.step_one(score, v_new, acc, l_i, m_i)

    if FP8_CACHE:
        acc = acc * v_scale
    has_tokens = l_i > 0.0  # false for a padded row (seq_len 0); empty split partitions returned above
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    out_mask = group_mask[:, None] & dim_mask[None, :]
    if not SPLIT:
        _store_heads(out_ptr, out, seq, q_heads, dims, out_mask, stride_out_seq, stride_out_head)
    elif not MERGE_IN_LAUNCH:
        # _merge_partitions (the next launch) combines the partitions holding tokens; a padded row
        # stores zeros and lse -inf in its first.
        row_id = (seq * num_q_heads + q_heads) * num_splits + split
        _store_partial(
            part_out_ptr, part_lse_ptr, out, m_i, l_i, has_tokens, row_id, dims, out_mask, group_mask, BLOCK_D, True
        )
    elif num_parts == 1:  # the context fits one partition (split 0): no partials, no merge
        _store_heads(out_ptr, out, seq, q_heads, dims, out_mask, stride_out_seq, stride_out_head)
    else:
        row_id = (seq * num_q_heads + q_heads) * num_splits + split  # [G] index into [B, Hq, S]
        _store_partial(
            part_out_ptr, part_lse_ptr, out, m_i, l_i, has_tokens, row_id, dims, out_mask, group_mask, BLOCK_D, False
        )
        _merge_if_last(
            counters_ptr,
            part_out_ptr,
            part_lse_ptr,
            out_ptr,
            seq,
            kv_head,
            num_kv_heads,
            num_q_heads,
            num_parts,
            num_splits,
            dims,
            dim_mask,
            stride_out_seq,
            stride_out_head,
            QUERY_GROUP,
            SPLITS_PAD,
            BLOCK_D,
        )


@triton.jit
def _window_context(seq_len, WINDOW: tl.constexpr):
    """(first position, length) of the context the query at seq_len - 1 reads: with a WINDOW (a
    sliding layer), its last WINDOW positions, else all of them."""
    if WINDOW > 0:
        ctx_begin = tl.maximum(seq_len - WINDOW, 0)
        return ctx_begin, seq_len - ctx_begin
    return 0, seq_len


@triton.jit
def _sequence_partitions(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """(partition_size, num_parts) sized for this sequence's own context: whole tiles, at most
    num_splits partitions, so a short context in a graph captured for long ones still spreads over
    as many programs as it has tiles (a split launch merged by _merge_partitions; both cut the same)."""
    tiles = tl.maximum((seq_len + BLOCK_N - 1) // BLOCK_N, 1)
    tiles_per_part = (tiles + num_splits - 1) // num_splits
    partition_size = tiles_per_part * BLOCK_N
    num_parts = (tiles + tiles_per_part - 1) // tiles_per_part
    return partition_size, num_parts


@triton.jit
def _attend_cached(
    q,
    seq,
    kv_head,
    start,
    end,
    dims,
    dim_mask,
    block_tables_ptr,
    stride_block_tables_seq,
    cache_ptr,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    qk_scale,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    FP8_V_PAIRS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """(m_i, l_i, acc) of the query heads q [GROUP_PAD, BLOCK_D] over the cached tokens start..end of
    this (sequence, kv head), BLOCK_N at a time (online_softmax; scores times qk_scale, log2 units)."""
    dtype = q.dtype
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    head_base = cache_ptr + kv_head * stride_cache_head
    if FP8_AS_F16:
        # An FP8 tile widens to float16 at one instruction per two values; to bfloat16 it would go
        # through float16 and then a conversion per value (sm_90's SASS for this loop: 256 of them
        # a thread per 128-key tile). The dots take float16 operands: the cache's values exactly,
        # the query exactly within float16's range (clamped to it), the probabilities rounded
        # finer than bfloat16 would.
        q_dot = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        q_dot = q
    if FP8_V_PAIRS:  # word offsets: the cache's strides are even (the launcher checks)
        v_words = (head_base + stride_cache_kv).to(tl.pointer_type(tl.uint16))
        pairs = tl.arange(0, BLOCK_D // 2)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_offset
        kv_mask = valid[None, :] & dim_mask[:, None]
        k_t = tl.load(head_base + row[None, :] + dims[:, None], mask=kv_mask, other=0.0)  # [D, N]
        if FP8_AS_F16:
            k_t = k_t.to(tl.float16)
        elif FP8_CACHE:
            k_t = k_t.to(dtype)
        scores = online_softmax.dot(q_dot, k_t, DOT_FP32, DOT_PRECISION)
        scores = scores * qk_scale  # [G, N], log2 units
        scores = tl.where(valid[None, :], scores, float("-inf"))
        if FP8_V_PAIRS:
            # V read as 16-bit words, two adjacent dims of a position each, and widened in
            # registers: the dot reads V across positions, which for 8-bit values (no transposing
            # ldmatrix) Triton gathers from shared memory a byte at a time (sm_90 PTX: 128
            # ld.shared.b8 a thread per 128-key tile). Little-endian: the low byte is the even dim.
            words = tl.load(v_words + row[:, None] // 2 + pairs[None, :], mask=valid[:, None], other=0)
            low = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
            high = (words >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
            v = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_D))
        else:
            v = tl.load(
                head_base + stride_cache_kv + row[:, None] + dims[None, :],
                mask=valid[:, None] & dim_mask[None, :],
                other=0.0,
            )  # [N, D]
            if FP8_AS_F16:
                v = v.to(tl.float16)
            elif FP8_CACHE:
                v = v.to(dtype)
        acc, l_i, m_i = online_softmax.step(scores, v, acc, l_i, m_i, DOT_FP32, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _store_heads(out_ptr, out, seq, q_heads, dims, mask, stride_out_seq, stride_out_head):
    """The normalised output of the query heads q_heads [G] into out [B, Hq, D]."""
    tl.store(
        out_ptr + seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _store_partial(
    part_out_ptr,
    part_lse_ptr,
    out,
    m_i,
    l_i,
    has_tokens,
    row_id,
    dims,
    out_mask,
    group_mask,
    BLOCK_D: tl.constexpr,
    MAY_BE_EMPTY: tl.constexpr,
):
    """A partition's output and log-sum-exp (log2 units) for rows row_id [G] of [B, Hq, S] (partials
    [B, Hq, S, BLOCK_D], one flat stride). MAY_BE_EMPTY: a padded row (no tokens) stores lse -inf."""
    tl.store(part_out_ptr + row_id[:, None] * BLOCK_D + dims[None, :], out, mask=out_mask)
    if MAY_BE_EMPTY:
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row_id, lse, mask=group_mask)
    else:  # every partition holds tokens (num_parts > 1). The address before the sum: as in the
        # other branch, the order of the two is the order of the compiled code.
        tl.store(part_lse_ptr + row_id, m_i + tl.log2(l_i), mask=group_mask)


@triton.jit
def _merge_if_last(
    counters_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq,
    kv_head,
    num_kv_heads,
    num_q_heads,
    num_parts,
    num_splits,
    dims,
    dim_mask,
    stride_out_seq,
    stride_out_head,
    QUERY_GROUP: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The last partition of this (sequence, kv head) to finish merges them all, so no second kernel
    is launched. The barrier puts every thread's partial stores before the increment (a release);
    its acquire side makes the other programs' partials visible to the merger."""
    tl.debug_barrier()
    counter = counters_ptr + seq * num_kv_heads + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == num_parts - 1:
        tl.store(counter, 0)  # zero again for the next launch or graph replay
        splits = tl.arange(0, SPLITS_PAD)
        split_mask = splits < num_parts
        # One head at a time, all of its partials in one [SPLITS_PAD, BLOCK_D] tile, read from
        # L2 (.cg), where the other programs' stores landed.
        for g in tl.static_range(QUERY_GROUP):
            head = kv_head * QUERY_GROUP + g
            head_row = (seq * num_q_heads + head) * num_splits
            lse = tl.load(part_lse_ptr + head_row + splits, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
            weight = tl.where(split_mask, tl.exp2(lse - tl.max(lse, 0)), 0.0)
            parts = tl.load(
                part_out_ptr + (head_row + splits)[:, None] * BLOCK_D + dims[None, :],
                mask=split_mask[:, None] & dim_mask[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            merged = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
            tl.store(
                out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
                merged.to(out_ptr.dtype.element_ty),
                mask=dim_mask,
            )


def _merge_partitions_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq_lens_ptr,
    stride_out_seq,
    stride_out_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """One (sequence, query head): the softmax-weighted sum of its partitions' partial outputs."""
    if USE_PDL:  # see launch.pdl_options; the next kernel may launch at once, as in _paged_decode
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    row_base = (seq * tl.num_programs(1) + head) * num_splits
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOW > 0:  # as _paged_decode_kernel: the window's positions only
        seq_len = tl.minimum(seq_len, WINDOW)
    _, num_parts = _sequence_partitions(seq_len, num_splits, BLOCK_N)  # as _paged_decode_kernel cut it
    split_mask = splits < num_parts  # the partitions that stored a partial
    lse = tl.load(part_lse_ptr + row_base + splits, mask=split_mask, other=float("-inf"))
    parts = tl.load(
        part_out_ptr + (row_base + splits)[:, None] * BLOCK_D + dims[None, :],
        mask=split_mask[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    lse_max = tl.max(lse, 0)
    has_tokens = lse > float("-inf")
    weight = tl.where(has_tokens, tl.exp2(lse - tl.where(has_tokens, lse_max, 0.0)), 0.0)
    total = tl.sum(weight, 0)
    merged = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


_merge_partitions = lazy_jit(_merge_partitions_kernel, do_not_specialize=("seq_lens_ptr", "num_splits"))

# Arguments that change from step to step: one compiled variant whatever their alignment or value.
_paged_decode = lazy_jit(
    _paged_decode_kernel,
    do_not_specialize=(
        "block_tables_ptr",
        "seq_lens_ptr",
        "counters_ptr",
        "positions_ptr",
        "slot_mapping_ptr",
        "stride_block_tables_seq",
        "partition_size",
        "num_splits",
    ),
)

_SM_COUNT: dict[int, int] = {}


def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: any small number exercises the same split logic
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per sequence: a few programs per multiprocessor, partitions of >= MIN_PARTITION tokens."""
    programs = max(1, num_seqs * num_kv_heads)
    multiprocessors = multiprocessor_count(device)
    waves = _WAVES_SMALL_BATCH if programs < multiprocessors else _WAVES
    wanted = math.ceil(waves * multiprocessors / programs)
    by_length = math.ceil(max(1, max_seq_len) / MIN_PARTITION)
    return max(1, min(wanted, by_length, MAX_SPLITS))


# The tiles measured on each device: configs/paged_decode/<device>.json, {(query dtype, max_head_dim,
# fills_device): block_n, num_warps, num_stages} from bench/kernel_times.py; a launch takes the record
# with the smallest max_head_dim holding its head_dim. A batch that fills the device is bandwidth-bound
# (long tiles with more loads in flight pay), a small one latency-bound and cut into many short
# partitions, hence fills_device. float16 takes the bfloat16 records (the same bytes per element; the
# sweeps time bfloat16), and an FP8 cache its query dtype's.
TABLE_KEY = ("dtype", "max_head_dim", "fills_device")


def default_tile(
    dtype: torch.dtype, head_dim: int, fills_device: bool, device: torch.device | None = None
) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of a launch whose batch x kv heads programs fill the
    multiprocessors of `device` (fills_device) or not: the device's measured tile (None: the current
    device's), else a default.

    float32 tiles go through FMA-based IEEE dots, which spill registers beyond 16 keys a tile at
    head_dim 128 (Triton's resource report for sm_90); float32 serves exactness, not speed. Without a
    measured tile, a short one on 8 warps: what a latency-bound batch wants, and light on registers;
    32 keys beyond head_dim 128.
    """
    if dtype == torch.float32:
        return 16, 4, 2
    table = configs.table("paged_decode", TABLE_KEY, device)
    sizes = [size for (kind, size, fills) in table if kind == "bfloat16" and fills == fills_device]
    size = configs.bucket(head_dim, sizes)
    if size is not None:
        tile = table[("bfloat16", size, fills_device)]
        return tile["block_n"], tile["num_warps"], tile["num_stages"]
    if head_dim > 128:
        return 32, 8, 2
    return 64, 8, 2


@dataclass(frozen=True)
class NewTokens:
    """This step's token of each decode sequence, for a launch that rotates and caches it itself.

    The query passed with it is not rotated yet. The launch rotates it and key (rotary as
    kernels.rotary applies it, cos_cache/sin_cache [max_positions, rot_dim // 2]), stores the
    rotated key and value at kv_cache[:, slot_mapping[b]] (nothing for a slot < 0), and attends to
    the cache's first seq_lens[b] - 1 tokens plus this one, taken from registers: one launch instead
    of apply_rotary_and_cache and then the attention. positions [B]; key, value [B, Hkv, D] (strided
    views of a fused qkv will do); slot_mapping [B]. qk_norm: each head of the query and key is
    normalised first (Qwen3's q_norm and k_norm; kernels.qk_norm), in the same launch.
    """

    positions: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    qk_norm: QKNorm | None = None


class SplitCounters:
    """Arrival counters for the in-kernel merge: one int32 per (sequence, kv head), zero between launches.

    Every launch leaves its counters at zero again, so one buffer serves every layer and every replay
    of a CUDA graph, provided the launches sharing it run one after another (one stream). A larger
    batch gets a larger buffer; earlier ones are kept alive because captured graphs still use them.
    """

    def __init__(self, minimum_size: int = 4096) -> None:
        self.minimum_size = minimum_size
        self._buffers: list[torch.Tensor] = []

    def get(self, size: int, device: torch.device) -> torch.Tensor:
        for buffer in reversed(self._buffers):
            if buffer.device == device and buffer.numel() >= size:
                return buffer
        buffer = torch.zeros(max(size, self.minimum_size), dtype=torch.int32, device=device)
        self._buffers.append(buffer)
        return buffer


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    num_splits: int | None = None,
    merge_in_launch: bool | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    new_tokens: NewTokens | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_v_pairs: bool | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attention of query [B, Hq, D] over each sequence's first seq_lens[b] cached tokens -> [B, Hq, D].

    kv_cache [2, num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] and seq_lens [B] live
    on the device (int32/int64) and are never read on the host. max_seq_len is a host upper bound on
    seq_lens that picks the number of splits (`num_splits` overrides it); for a CUDA graph, capture
    with the largest max_seq_len the graph will replay with. A sequence with seq_len 0 gets zeros.

    counters: int32 zeros, at least B * Hkv of them (SplitCounters hands them out), which a split
    launch merging in the launch uses and leaves zero; without it such a launch allocates zeros (one
    memset more).

    new_tokens: the step's own tokens, not yet rotated nor cached (see NewTokens); query is then
    not rotated either.

    k_scale, v_scale: a float8_e4m3fn cache's scales (kv_cache_quant.py; other caches ignore them).

    block_n, num_warps, num_stages: the tile (keys per iteration) and launch shape; None takes
    default_tile's.

    fp8_v_pairs: an FP8 cache's values read as 16-bit words and widened in registers (see the
    kernel); None takes FP8_V_PAIRS (on: faster on the H200).

    window: a sliding-window layer's window (0: off): the query at position seq_len - 1 attends to the
    last `window` positions only, and only their blocks are read; the partitions cut that context.

    merge_in_launch: how a split launch combines its partitions. True: the last partition of each
    (sequence, kv head) to finish merges them (one launch). False: every partition stores its
    partial and a second, small kernel merges them. None picks what measured faster on Hopper: the
    second kernel while B * Hkv programs do not fill the multiprocessors, the in-launch merge from
    there on (BENCHMARKS.md, "Paged decode attention: merge in the same launch vs a separate merge
    kernel").
    """
    _, num_kv_heads, half = _checked(query, kv_cache, block_tables, seq_lens, max_seq_len, out, counters, new_tokens)
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be a non-negative integer (0: off), got {window!r}")
    out = torch.empty_like(query) if out is None else out
    num_seqs, num_q_heads, head_dim = query.shape
    if num_seqs == 0:
        return out
    launch = _pick_launch(
        num_seqs,
        num_kv_heads,
        head_dim,
        query.dtype,
        min(max_seq_len, window) if window else max_seq_len,  # the longest context a query reads
        query.device,
        num_splits=num_splits,
        merge_in_launch=merge_in_launch,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    variant = DecodeVariant.of(query, kv_cache, launch, new_tokens, half, fp8_v_pairs, window)
    _launch(
        query,
        kv_cache,
        block_tables,
        seq_lens,
        float(scale),
        out,
        counters,
        new_tokens,
        check_kv_scales(k_scale, v_scale),
        launch,
        variant,
    )
    return out


@dataclass(frozen=True)
class DecodeVariant:
    """Which compiled variant of _paged_decode_kernel a launch runs: the shapes it is specialised for
    and its feature switches. constexprs() is the one place where they become the kernel's
    constexpr arguments."""

    block_size: int  # the cache's tokens per block
    query_group: int  # query heads per kv head
    head_dim: int
    block_n: int  # keys per tile
    num_splits: int  # partitions of the longest context (flash-decoding); 1: the context in one
    dtype: torch.dtype  # the queries', which sets the dots' precision (launch.dot_options)
    merge_in_launch: bool = False  # a split launch's partitions merged by the last to finish
    new_token: bool = False  # the step's own tokens rotated, cached and attended in the launch
    rotary_half: int = 0  # with new_token: half the rotated width
    qk_norm: bool = False  # with new_token: each head of their query and key normalised first
    fp8_cache: bool = False  # a float8_e4m3fn cache (with k_scale and v_scale)
    fp8_as_f16: bool = False  # its tiles widened to float16 (half-precision queries)
    fp8_v_pairs: bool = False  # its values read as 16-bit words (paged_decode_attention's fp8_v_pairs)
    window: int = 0  # a sliding-window layer's window (0: the whole context)

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        launch: _Launch,
        new_tokens: NewTokens | None,
        rotary_half: int,
        fp8_v_pairs: bool | None,
        window: int = 0,
    ) -> DecodeVariant:
        """The variant of a checked call (rotary_half: _checked's) with launch shape `launch`."""
        head_dim = query.shape[2]
        fp8 = is_fp8_cache(kv_cache)
        fp8_as_f16 = fp8 and query.dtype != torch.float32
        return cls(
            block_size=kv_cache.shape[2],
            query_group=query.shape[1] // kv_cache.shape[3],
            head_dim=head_dim,
            block_n=launch.block_n,
            num_splits=launch.num_splits,
            dtype=query.dtype,
            merge_in_launch=launch.merge_in_launch,
            new_token=new_tokens is not None,
            rotary_half=rotary_half,
            qk_norm=new_tokens is not None and new_tokens.qk_norm is not None,
            fp8_cache=fp8,
            fp8_as_f16=fp8_as_f16,
            fp8_v_pairs=fp8_as_f16 and _v_pairs_apply(kv_cache, head_dim, fp8_v_pairs),
            window=window,
        )

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    @property
    def block_d(self) -> int:
        return next_power_of_2(self.head_dim)

    def constexprs(self) -> dict[str, object]:
        """_paged_decode_kernel's constexpr arguments (USE_PDL aside: launch.pdl_options, as for every kernel)."""
        return dict(
            BLOCK_SIZE=self.block_size,
            QUERY_GROUP=self.query_group,
            GROUP_PAD=max(16, next_power_of_2(self.query_group)),
            HEAD_DIM=self.head_dim,
            BLOCK_D=self.block_d,
            BLOCK_N=self.block_n,
            SPLITS_PAD=next_power_of_2(self.num_splits),
            SPLIT=self.split,
            MERGE_IN_LAUNCH=self.merge_in_launch,
            **dot_options(self.dtype),
            NEW_TOKEN=self.new_token,
            HALF=self.rotary_half,
            QK_NORM=self.qk_norm,
            FP8_CACHE=self.fp8_cache,
            FP8_AS_F16=self.fp8_as_f16,
            FP8_V_PAIRS=self.fp8_v_pairs,
            WINDOW=self.window,
        )

    def merge_constexprs(self) -> dict[str, object]:
        """_merge_partitions' constexpr arguments, for a split launch it merges."""
        return dict(
            HEAD_DIM=self.head_dim,
            BLOCK_N=self.block_n,
            BLOCK_D=self.block_d,
            SPLITS_PAD=next_power_of_2(self.num_splits),
            WINDOW=self.window,
        )


def _launch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    counters: torch.Tensor | None,
    new_tokens: NewTokens | None,
    kv_scales: tuple[float, float],
    launch: _Launch,
    variant: DecodeVariant,
) -> None:
    """The kernel for a checked call, and _merge_partitions after it for a split launch that does
    not merge in the launch."""
    num_seqs, num_q_heads, _ = query.shape
    num_kv_heads = num_q_heads // variant.query_group
    device = query.device
    part_out, part_lse, counters = _partials(variant, num_seqs, num_q_heads, num_kv_heads, out, counters, seq_lens)
    rotary_args, rotary_strides = _new_token_operands(new_tokens, query, seq_lens)
    k_scale, v_scale = kv_scales
    _paged_decode[(num_seqs, num_kv_heads, variant.num_splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        counters,
        *rotary_args,
        scale * _LOG2E * (k_scale if variant.fp8_cache else 1.0),
        k_scale,
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
        *rotary_strides,
        launch.partition_size,
        variant.num_splits,
        **variant.constexprs(),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **pdl_options(device),
    )
    if variant.split and not variant.merge_in_launch:
        _merge_partitions[(num_seqs, num_q_heads)](
            part_out,
            part_lse,
            out,
            seq_lens,
            out.stride(0),
            out.stride(1),
            variant.num_splits,
            **variant.merge_constexprs(),
            num_warps=4,
            **pdl_options(device),
        )


def _partials(
    variant: DecodeVariant,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    out: torch.Tensor,
    counters: torch.Tensor | None,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """(part_out, part_lse, counters): a split launch's partial outputs, their log-sum-exps and the
    in-launch merge's arrival counters. What a variant does not use, the kernel never touches: `out`
    and `seq_lens` stand in."""
    if not variant.split:
        return out, out, seq_lens
    device = out.device
    # Padded to BLOCK_D so the merge can use one flat stride. Never initialised: only the
    # partitions holding tokens write theirs, and only those are read.
    part_out = torch.empty(
        (num_seqs, num_q_heads, variant.num_splits, variant.block_d), dtype=torch.float32, device=device
    )
    part_lse = torch.empty((num_seqs, num_q_heads, variant.num_splits), dtype=torch.float32, device=device)
    if counters is None and variant.merge_in_launch:
        counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=device)
    elif counters is None:
        counters = seq_lens  # unused without the in-launch merge
    return part_out, part_lse, counters


def _checked(query, kv_cache, block_tables, seq_lens, max_seq_len, out, counters, new_tokens) -> tuple[int, int, int]:
    """Check a call's arguments (see paged_decode_attention); return the cache's block_size, its
    number of kv heads and, with new_tokens, half the rotated width (else 0)."""
    block_size, num_kv_heads = check_query_and_cache(query, kv_cache)
    device = query.device
    num_seqs = query.shape[0]
    check_block_tables(block_tables, num_seqs, device, counted_in="query")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_host_bound("max_seq_len", max_seq_len)
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds what block_tables can address "
            f"({block_tables.shape[1]} blocks of {block_size})"
        )
    if out is not None:
        check_operand("out", out, tuple(query.shape), query.dtype, device)
    if counters is not None:
        check_tensor("counters", counters, ndim=1, dtypes=(torch.int32,), device=device)
        check_contiguous("counters", counters)
        if counters.numel() < num_seqs * num_kv_heads:
            raise ValueError(
                f"counters holds {counters.numel()} entries but the launch needs "
                f"num_seqs * num_kv_heads = {num_seqs * num_kv_heads}"
            )
    if new_tokens is None:
        return block_size, num_kv_heads, 0
    t = new_tokens
    half = check_rotary(t.positions, query, t.key, t.cos_cache, t.sin_cache)
    if t.qk_norm is not None:
        check_qk_norm(t.qk_norm, query, half)
    check_kv_cache_write(t.key, t.value, kv_cache, t.slot_mapping)  # also key's heads against the cache
    return block_size, num_kv_heads, half


@dataclass(frozen=True)
class _Launch:
    """The shape of one launch: its tile, its partitions of the context and how they are merged."""

    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    partition_size: int
    merge_in_launch: bool


# Whether an FP8 cache's V tiles are read as 16-bit words (paged_decode_attention's fp8_v_pairs): half
# the load instructions for the same bytes (bench/kernel_times.py --fp8-decode-only: 1.07x -> 1.22x
# bf16's speed at batch 512 on the H200; BENCHMARKS.md).
FP8_V_PAIRS = True


def _v_pairs_apply(kv_cache: torch.Tensor, head_dim: int, asked: bool | None) -> bool:
    """fp8_v_pairs for this cache: asked (or FP8_V_PAIRS), where words can tile its rows (whole,
    power-of-two head dims; an even address and even strides, as every cache the engine allocates has)."""
    wanted = FP8_V_PAIRS if asked is None else asked
    even = kv_cache.data_ptr() % 2 == 0 and all(stride % 2 == 0 for stride in kv_cache.stride()[:4])
    return wanted and head_dim == next_power_of_2(head_dim) and head_dim >= 2 and even


def _pick_launch(
    num_seqs: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_seq_len: int,
    device: torch.device,
    *,
    num_splits: int | None,
    merge_in_launch: bool | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> _Launch:
    """The call's own choices, the rest from default_tile and choose_num_splits; partitions are
    whole tiles, so only the last tile of a partition needs its tail masked."""
    fills_device = num_seqs * num_kv_heads >= multiprocessor_count(device)
    tile = default_tile(dtype, head_dim, fills_device, device)
    block_n = tile[0] if block_n is None else block_n
    num_warps = tile[1] if num_warps is None else num_warps
    num_stages = tile[2] if num_stages is None else num_stages
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    tiles = max(1, triton.cdiv(max_seq_len, block_n))
    partition_size = triton.cdiv(tiles, num_splits) * block_n
    num_splits = max(1, triton.cdiv(max_seq_len, partition_size))
    return _Launch(
        block_n,
        num_warps,
        num_stages,
        num_splits,
        partition_size,
        fills_device if merge_in_launch is None else merge_in_launch,
    )


def _new_token_operands(
    new_tokens: NewTokens | None, query: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The rotary, norm and cache-write operands and the strides the kernel takes with NEW_TOKEN."""
    if new_tokens is None:  # unused without NEW_TOKEN: any pointers of the right kinds will do
        return (seq_lens, query, query, query, query, seq_lens, query, query, 1.0), (0,) * 6
    t = new_tokens
    # Unused without QK_NORM: the query stands in for the weights.
    norm = (query, query, 1.0) if t.qk_norm is None else (t.qk_norm.q_weight, t.qk_norm.k_weight, float(t.qk_norm.eps))
    return (
        (t.positions, t.key, t.value, t.cos_cache, t.sin_cache, t.slot_mapping, *norm),
        (
            t.key.stride(0),
            t.key.stride(1),
            t.value.stride(0),
            t.value.stride(1),
            t.cos_cache.stride(0),
            t.sin_cache.stride(0),
        ),
    )


def paged_decode_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    new_tokens: NewTokens | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
) -> torch.Tensor:
    """Pure-torch reference: gather each sequence's context through its block table, softmax in fp32
    (with a window: its last `window` positions only).

    With new_tokens: rotate query and key and write key and value into kv_cache first (in place), as
    apply_rotary_and_cache does."""
    if new_tokens is not None:
        t = new_tokens
        query = apply_rotary_and_cache_reference(
            t.positions,
            query,
            t.key,
            t.value,
            t.cos_cache,
            t.sin_cache,
            kv_cache,
            t.slot_mapping,
            k_scale,
            v_scale,
            t.qk_norm,
        )
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        positions = torch.arange(max(0, seq_len - window) if window else 0, seq_len, device=query.device)
        blocks = block_tables[i].long()[positions // block_size]
        keys = dequantize_kv(kv_cache[0, blocks, positions % block_size], k_scale)  # [L, Hkv, D]
        values = dequantize_kv(kv_cache[1, blocks, positions % block_size], v_scale)
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[i].float(), keys) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values).to(query.dtype)
    return out
