"""Neox-style (rotate-half) rotary embedding applied to queries and keys in place, in one launch.

apply_rotary_and_cache also stores the rotated keys and the values in the paged KV cache in that
same launch (the decode path's rotary + kv_cache_write, one kernel instead of two).

cos/sin layout as gpuworker.models.layers.RotaryEmbedding keeps it: cos_cache and sin_cache
[max_positions, rot_dim // 2] in float32, one half of HF's repeated cos/sin. The first rot_dim
dimensions of every head are rotated (all of them for Llama). Numerics replay HF's eager ops in the
activation dtype: cos/sin cast to it, each product rounded, then the sum rounded, so bf16 results are
bit-identical to transformers'.

With a QKNorm (Qwen3's q_norm and k_norm) the launch first applies each head's RMSNorm, as
models.layers.RMSNorm computes it (float32, rounded to the activation dtype, times the weight, rounded
again), then rotates: the model's two norm launches and their copies go away.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gpuworker.kernels.attention.kv_cache_write import check_kv_cache_write, kv_cache_write_reference
from gpuworker.kernels.device import fp8_codec, rotary_cache
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_last_dim_contiguous,
    check_shape,
    check_tensor,
    lazy_jit,
    next_power_of_2,
    pdl_options,
)
from gpuworker.kernels.norm.qk_norm import QKNorm, check_qk_norm, qk_norm_reference
from gpuworker.kernels.quant.kv_cache import check_kv_scales, is_fp8_cache


def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    q_norm_ptr,
    k_norm_ptr,
    norm_eps,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cos_position,
    stride_sin_position,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options: wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < HALF
    dtype = query_ptr.dtype.element_ty
    cos, sin = rotary_cache.cos_sin(
        cos_ptr, sin_ptr, position, stride_cos_position, stride_sin_position, dims, dim_mask, 0.0, dtype
    )
    cos = cos[None, :]
    sin = sin[None, :]

    heads = tl.arange(0, BLOCK_HQ)[:, None]
    mask = (heads < NUM_Q_HEADS) & dim_mask[None, :]
    first = query_ptr + token * stride_query_token + heads * stride_query_head + dims[None, :]
    # With QK_NORM the head's RMSNorm first (the launcher checked that the halves are the whole head).
    out1, out2 = rotary_cache.rotate_halves(
        first, mask, cos, sin, q_norm_ptr, dims, dim_mask, norm_eps, dtype, HALF, HEAD_DIM, QK_NORM
    )
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)

    heads = tl.arange(0, BLOCK_HK)[:, None]
    mask = (heads < NUM_KV_HEADS) & dim_mask[None, :]
    first = key_ptr + token * stride_key_token + heads * stride_key_head + dims[None, :]
    out1, out2 = rotary_cache.rotate_halves(
        first, mask, cos, sin, k_norm_ptr, dims, dim_mask, norm_eps, dtype, HALF, HEAD_DIM, QK_NORM
    )
    if WRITE_CACHE:
        # The rotated keys go to the cache only (attention reads them from there), rounded to the
        # activation dtype first so the cache holds what apply_rotary + kv_cache_write would store
        # (an FP8 cache: divided by the scale and clamped, as kv_cache_write does).
        cache_dtype = cache_ptr.dtype.element_ty
        out1 = out1.to(dtype).to(tl.float32)
        out2 = out2.to(dtype).to(tl.float32)
        if FP8_CACHE:
            out1 = fp8_codec.quantize(out1, k_scale)
            out2 = fp8_codec.quantize(out2, k_scale)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        keep = rotary_cache.slot_kept(heads, slot)  # padding tokens (slot < 0) store nothing
        row = rotary_cache.slot_row(
            cache_ptr, slot, heads, stride_cache_block, stride_cache_offset, stride_cache_head, CACHE_BLOCK_SIZE
        )
        tl.store(row + dims[None, :], out1.to(cache_dtype), mask=mask & keep)
        tl.store(row + HALF + dims[None, :], out2.to(cache_dtype), mask=mask & keep)
        all_dims = tl.arange(0, BLOCK_D)[None, :]
        if 2 * HALF < HEAD_DIM:  # partial rotary: the key's tail is copied as it is
            tail = (heads < NUM_KV_HEADS) & (all_dims >= 2 * HALF) & (all_dims < HEAD_DIM) & keep
            k_tail = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + all_dims, mask=tail)
            if FP8_CACHE:
                k_tail = fp8_codec.quantize(k_tail, k_scale)
            tl.store(row + all_dims, k_tail.to(cache_dtype), mask=tail)
        full = (heads < NUM_KV_HEADS) & (all_dims < HEAD_DIM) & keep
        v = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + all_dims, mask=full)
        if FP8_CACHE:
            v = fp8_codec.quantize(v, v_scale)
        tl.store(row + stride_cache_kv + all_dims, v.to(cache_dtype), mask=full)
    else:
        tl.store(first, out1.to(dtype), mask=mask)
        tl.store(first + HALF, out2.to(dtype), mask=mask)


# Arguments that change from step to step: one compiled variant whatever their alignment or value.
_rotary = lazy_jit(_rotary_kernel, do_not_specialize=("positions_ptr", "slot_mapping_ptr"))


def check_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> int:
    """Check apply_rotary's arguments; return half the rotated width (cos_cache's width)."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    device = query.device
    num_tokens, _, head_dim = query.shape
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), device=device)
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key must have shape [{num_tokens}, num_kv_heads, {head_dim}], got {tuple(key.shape)}")
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("positions", positions, (num_tokens,))
    check_tensor("cos_cache", cos_cache, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("sin_cache", sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_shape("sin_cache", sin_cache, tuple(cos_cache.shape))
    half = cos_cache.shape[1]
    if not 0 < 2 * half <= head_dim:
        raise ValueError(f"cos_cache's width {half} must be in [1, head_dim // 2 = {head_dim // 2}]")
    for name, tensor in (("query", query), ("key", key), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_last_dim_contiguous(name, tensor)
    return half


def _launch(positions, query, key, cos_cache, sin_cache, half, cache_write=None, qk_norm=None) -> None:
    """One program per token; cache_write = (value, kv_cache, slot_mapping, k_scale, v_scale) also
    fills the cache; qk_norm (a checked QKNorm) normalises the heads first."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if cache_write is None:
        # Unused without WRITE_CACHE: any pointers of the right kinds will do.
        value, kv_cache, slot_mapping, k_scale, v_scale = key, query, positions, 1.0, 1.0
        cache_strides, cache_block_size = (0, 0, 0, 0), 1
    else:
        value, kv_cache, slot_mapping, k_scale, v_scale = cache_write
        cache_strides, cache_block_size = kv_cache.stride()[:4], kv_cache.shape[2]
    # Unused without QK_NORM: any pointers of the query's dtype will do.
    q_norm, k_norm, eps = (query, query, 1.0) if qk_norm is None else (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)
    _rotary[(num_tokens,)](
        positions,
        query,
        key,
        value,
        cos_cache,
        sin_cache,
        kv_cache,
        slot_mapping,
        k_scale,
        v_scale,
        q_norm,
        k_norm,
        float(eps),
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        *cache_strides,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_HQ=next_power_of_2(num_q_heads),
        BLOCK_HK=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_D=next_power_of_2(head_dim),
        CACHE_BLOCK_SIZE=cache_block_size,
        WRITE_CACHE=cache_write is not None,
        FP8_CACHE=is_fp8_cache(kv_cache),
        QK_NORM=qk_norm is not None,
        **pdl_options(query.device),
    )


def apply_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place by positions [T]; returns (query, key).

    query/key may be strided views (slices of a fused qkv output) with a contiguous last dimension.
    cos_cache/sin_cache: [max_positions, rot_dim // 2], rot_dim <= D. Positions must be below
    max_positions (not checked: that would need a device sync). qk_norm: normalise each head first
    (rot_dim == D then).
    """
    half = check_rotary(positions, query, key, cos_cache, sin_cache)
    if qk_norm is not None:
        check_qk_norm(qk_norm, query, half)
    if query.shape[0] == 0:
        return query, key
    _launch(positions, query, key, cos_cache, sin_cache, half, qk_norm=qk_norm)
    return query, key


def apply_rotary_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """apply_rotary, then kv_cache_write of the rotated key and value, in one launch; returns query.

    query is rotated in place; the rotated key goes to kv_cache[0, slot] only (key itself is not
    modified) and value to kv_cache[1, slot], for every slot >= 0 of slot_mapping [T]. The cache
    ends up bit-identical to apply_rotary followed by kv_cache_write. Arguments as for those two
    (k_scale and v_scale: an FP8 cache's scales; qk_norm: normalise query's and key's heads first).
    """
    half = check_rotary(positions, query, key, cos_cache, sin_cache)
    if qk_norm is not None:
        check_qk_norm(qk_norm, query, half)
    check_kv_cache_write(key, value, kv_cache, slot_mapping)
    scales = check_kv_scales(k_scale, v_scale)
    if query.shape[0] == 0:
        return query
    _launch(positions, query, key, cos_cache, sin_cache, half, (value, kv_cache, slot_mapping, *scales), qk_norm)
    return query


def apply_rotary_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference (out of place), written as transformers' apply_rotary_pos_emb (after
    Qwen3's q_norm and k_norm with a qk_norm)."""
    if qk_norm is not None:
        query, key = qk_norm_reference(qk_norm, query, key)
    rot_dim = 2 * cos_cache.shape[1]
    cos = cos_cache[positions.long()].to(query.dtype).unsqueeze(1)
    sin = sin_cache[positions.long()].to(query.dtype).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : rot_dim // 2], x[..., rot_dim // 2 : rot_dim]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot_dim:]), dim=-1)

    return rotate(query), rotate(key)


def apply_rotary_and_cache_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """Pure-torch reference: returns the rotated query (out of place) and writes the cache in place."""
    query, key = apply_rotary_reference(positions, query, key, cos_cache, sin_cache, qk_norm)
    kv_cache_write_reference(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    return query
