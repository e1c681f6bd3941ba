"""Write a step's new keys and values into a layer's paged KV cache through the slot mapping.

Slot s is block s // block_size, offset s % block_size of the cache
[2, num_blocks, block_size, num_kv_heads, head_dim]; slots < 0 mark padding tokens and are skipped.
An FP8 cache stores each value divided by its scale (k_scale, v_scale), as kv_cache_quant.py says.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gpuworker.kernels.device import fp8_codec
from gpuworker.kernels.launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_kv_cache,
    check_last_dim_contiguous,
    check_operand,
    check_shape,
    check_tensor,
    lazy_jit,
    next_power_of_2,
    pdl_options,
)
from gpuworker.kernels.quant.kv_cache import check_kv_scales, is_fp8_cache, quantize_kv


def _kv_cache_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options: wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # Padding tokens (slot < 0) store nothing. The slot test is broadcast to a tensor first because
    # Triton's interpreter mistypes `scalar_bool & tensor_bool` (an int mask it then rejects).
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & ((heads * 0 + slot) >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_offset + heads * stride_cache_head + dims
    if FP8_CACHE:
        k = fp8_codec.quantize(k, k_scale)
        v = fp8_codec.quantize(v, v_scale)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


_kv_cache_write = lazy_jit(_kv_cache_write_kernel)


def check_kv_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> int:
    """Check the arguments of a cache write (see kv_cache_write); return the cache's block_size."""
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    device = key.device
    check_last_dim_contiguous("key", key)
    check_operand("value", value, tuple(key.shape), key.dtype, device)
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, cache_heads, cache_dim = check_kv_cache(kv_cache, device=device)
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache holds {cache_heads} kv heads of dim {cache_dim}, "
            f"but key has {num_kv_heads} heads of dim {head_dim}"
        )
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    return block_size


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store key/value [T, num_kv_heads, head_dim] at kv_cache[:, slot] for each slot >= 0 (in place).

    key and value may be strided views (e.g. slices of a fused qkv projection) as long as their last
    dimension is contiguous; they are cast to the cache's dtype (float8_e4m3fn: divided by k_scale and
    v_scale first, see kv_cache_quant; other dtypes ignore the scales). slot_mapping [T] is int32 or int64 on
    the same device; slots must lie below num_blocks * block_size (not checked: that would need a
    device sync). gpuworker.kernels.attention.rotary.apply_rotary_and_cache does the same write fused with rotary.
    """
    block_size = check_kv_cache_write(key, value, kv_cache, slot_mapping)
    k_scale, v_scale = check_kv_scales(k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _kv_cache_write[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        FP8_CACHE=is_fp8_cache(kv_cache),
        **pdl_options(key.device),
    )


def kv_cache_write_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Pure-torch reference of kv_cache_write (in place)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = quantize_kv(key[keep], kv_cache.dtype, k_scale)
    kv_cache[1, blocks, offsets] = quantize_kv(value[keep], kv_cache.dtype, v_scale)
