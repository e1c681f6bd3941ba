"""The device side of a launch that takes the step's new tokens itself: rotary on their queries and
keys (rotate-half, HF's rounding), each head's RMSNorm before it (Qwen3's q_norm and k_norm), and the
key and value written to their slot of the paged cache as it stores them (FP8 included).

Two layouts share the rules: the rotary kernel holds heads as their two halves (the first and the
second HALF dims), the paged decode kernel holds whole heads with each dim's rotate-half partner
(rotary_pairs), which it loads beside them. Kernels call these through the module, so the
interpreter's launches can swap in interpretable twins (launch.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpuworker.kernels.device import fp8_codec, head_norm


@triton.jit
def cos_sin(cos_ptr, sin_ptr, position, stride_cos, stride_sin, columns, mask, COS_OTHER: tl.constexpr, dtype):
    """cos and sin of `position` at `columns` of cos/sin [max_positions, HALF] (masked lanes read
    COS_OTHER and 0), rounded to the activation dtype as HF's eager ops round them, in float32."""
    cos = tl.load(cos_ptr + position * stride_cos + columns, mask=mask, other=COS_OTHER)
    sin = tl.load(sin_ptr + position * stride_sin + columns, mask=mask, other=0.0)
    return cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)


@triton.jit
def rotate(x, partner, cos, sin, first_half, dtype):
    """Rotate-half of x, whose dims pair with partner's: x cos - partner sin where first_half, x cos +
    partner sin elsewhere, each product rounded to dtype first (HF's eager ops); in float32.
    first_half: a mask (whole heads), or True or False for a half of the two-halves layout (the
    compiler then drops the other sum)."""
    x_cos = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    partner_sin = (partner.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return tl.where(first_half, x_cos - partner_sin, x_cos + partner_sin)


@triton.jit
def slot_row(cache_ptr, slot, head, stride_block, stride_offset, stride_head, BLOCK_SIZE: tl.constexpr):
    """Where slot's key row for `head` starts in a cache [2, num_blocks, BLOCK_SIZE, heads, dim]:
    block slot // BLOCK_SIZE, offset slot % BLOCK_SIZE (its value row: + the cache's K/V stride)."""
    return cache_ptr + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset + head * stride_head


@triton.jit
def slot_kept(like, slot):
    """Whether slot is a token's (padding tokens have slot < 0 and store nothing), as a tensor shaped
    like `like` (an int tensor): the interpreter mistypes `scalar_bool & tensor_bool` masks."""
    return (like * 0 + slot) >= 0


@triton.jit
def rotate_halves(
    first,
    mask,
    cos,
    sin,
    norm_ptr,
    dims,
    dim_mask,
    eps,
    dtype,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    """Two-halves layout: heads loaded from `first` [H, BLOCK_HALF] (pointers to their first half;
    + HALF the second), each normalised first with QK_NORM (weight at norm_ptr; the halves are then
    the whole head), rotated: (first half, second half) in float32."""
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = head_norm.normalize_halves(x1, x2, norm_ptr, dims, dim_mask, eps, dtype, HALF, HEAD_DIM)
    return rotate(x1, x2, cos, sin, True, dtype), rotate(x2, x1, cos, sin, False, dtype)


@triton.jit
def rotary_pairs(dims, HALF: tl.constexpr):
    """Whole-head layout: (lower, rotated, partner, freq) of each dim d. Rotate-half over the first
    2 * HALF dims pairs d with d +- HALF (partner) and both take cos/sin column freq; the tail
    (not rotated) keeps cos 1 and sin 0."""
    lower = dims < HALF
    rotated = dims < 2 * HALF
    partner = tl.where(lower, dims + HALF, dims - HALF)
    freq = tl.where(lower, dims, dims - HALF)
    return lower, rotated, partner, freq


@triton.jit
def decode_token(
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
    cache_dtype,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    """A decode token's query heads q [G, D] (loaded from q_ptrs [G, 1]) rotated, and its key and
    value of kv_head as the cache stores them: (q, k, v), q in q's dtype.

    Whole-head layout: each dim is loaded with its partner, the tail keeps cos 1 and sin 0. With
    QK_NORM each head is normalised first (the partner tile is the same head permuted, so it takes
    the head's own 1 / rms)."""
    dtype = q.dtype
    lower, rotated, partner, freq = rotary_pairs(dims, HALF)
    cos, sin = cos_sin(cos_ptr, sin_ptr, position, stride_cos, stride_sin, freq, rotated, 1.0, dtype)
    q_partner = tl.load(q_ptrs + partner[None, :], mask=group_mask[:, None] & rotated[None, :], other=0.0)
    k_row = key_ptr + seq * stride_key_seq + kv_head * stride_key_head
    k = tl.load(k_row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    k_partner = tl.load(k_row + partner, mask=rotated, other=0.0).to(tl.float32)
    if QK_NORM:
        q32 = q.to(tl.float32)
        rstd = head_norm.rstd_of(tl.sum(q32 * q32, 1), norm_eps, HEAD_DIM)[:, None]
        q = head_norm.normalize(q32, rstd, tl.load(q_norm_ptr + dims, mask=dim_mask, other=0.0)[None, :], dtype).to(
            dtype
        )
        q_partner = head_norm.normalize(
            q_partner.to(tl.float32), rstd, tl.load(q_norm_ptr + partner, mask=rotated, other=0.0)[None, :], dtype
        )
        k_rstd = head_norm.rstd_of(tl.sum(k * k, 0), norm_eps, HEAD_DIM)
        k = head_norm.normalize(k, k_rstd, tl.load(k_norm_ptr + dims, mask=dim_mask, other=0.0), dtype)
        k_partner = head_norm.normalize(
            k_partner, k_rstd, tl.load(k_norm_ptr + partner, mask=rotated, other=0.0), dtype
        )
    q = rotate(q, q_partner, cos[None, :], sin[None, :], lower[None, :], dtype).to(dtype)
    k = rotate(k, k_partner, cos, sin, lower, dtype).to(dtype)
    v = tl.load(value_ptr + seq * stride_value_seq + kv_head * stride_value_head + dims, mask=dim_mask, other=0.0)
    if FP8_CACHE:  # as the cache stores them (their scales apply with the cached tokens')
        k = fp8_codec.quantize(k, k_scale).to(cache_dtype)
        v = fp8_codec.quantize(v, v_scale).to(cache_dtype)
    return q, k, v


@triton.jit
def cache_decode_token(
    cache_ptr,
    slot,
    kv_head,
    dims,
    dim_mask,
    k,
    v,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """Store decode_token's key and value of kv_head at slot (nothing for a padding slot < 0)."""
    keep = dim_mask & slot_kept(dims, slot)
    row = (
        slot_row(cache_ptr, slot, kv_head, stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_SIZE)
        + dims
    )
    tl.store(row, k.to(cache_ptr.dtype.element_ty), mask=keep)
    tl.store(row + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=keep)
