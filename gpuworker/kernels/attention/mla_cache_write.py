"""Store each new token's latent (after kv_a_layernorm) and rotated shared key into the paged latent
cache of multi-head latent attention: one row of kv_lora_rank + rope_dim values per token.

A Triton launch on the GPU, so padding rows (slot -1) are skipped without reading the slots on the
host (a decode step is captured in a CUDA graph); the torch reference beside it does the same with
a mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuworker.kernels.device import fp8_codec
from gpuworker.kernels.launch import lazy_jit
from gpuworker.kernels.quant.kv_cache import check_kv_scale, is_fp8_cache, quantize_kv


def _mla_cache_write_kernel(
    latent_ptr,  # [T, R]
    k_pe_ptr,  # [T, E]
    cache_ptr,  # [slots, R + E]
    slot_mapping_ptr,  # [T] int64
    kv_scale,
    stride_latent,
    stride_k_pe,
    stride_cache,
    KV_RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        e = tl.arange(0, BLOCK_E)
        row = cache_ptr + slot * stride_cache
        latent = tl.load(latent_ptr + t * stride_latent + r, mask=r < KV_RANK)
        k_pe = tl.load(k_pe_ptr + t * stride_k_pe + e, mask=e < ROPE)
        if FP8_CACHE:
            latent = fp8_codec.quantize(latent, kv_scale)
            k_pe = fp8_codec.quantize(k_pe, kv_scale)
        tl.store(row + r, latent.to(cache_ptr.dtype.element_ty), mask=r < KV_RANK)
        tl.store(row + KV_RANK + e, k_pe.to(cache_ptr.dtype.element_ty), mask=e < ROPE)


_mla_cache_write = lazy_jit(_mla_cache_write_kernel, do_not_specialize=("slot_mapping_ptr",))


def mla_cache_write(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """latent [T, R], k_pe [T, E] -> latent_cache (any view whose last dim is R + E and whose rows
    are slots) at slot_mapping [T]; slots < 0 are skipped. An FP8 cache stores each value divided by
    kv_scale."""
    cache = latent_cache.reshape(-1, latent_cache.shape[-1])
    num_tokens, kv_rank = latent.shape
    rope = k_pe.shape[1]
    if cache.shape[1] != kv_rank + rope or k_pe.shape[0] != num_tokens or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"latent {tuple(latent.shape)} and k_pe {tuple(k_pe.shape)} do not fit a cache of width {cache.shape[1]}"
        )
    if latent.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("latent and k_pe need contiguous rows")
    if num_tokens == 0:
        return
    _mla_cache_write[(num_tokens,)](
        latent,
        k_pe,
        cache,
        slot_mapping,
        check_kv_scale("kv_scale", kv_scale),
        latent.stride(0),
        k_pe.stride(0),
        cache.stride(0),
        KV_RANK=kv_rank,
        ROPE=rope,
        BLOCK_R=triton.next_power_of_2(kv_rank),
        BLOCK_E=triton.next_power_of_2(rope),
        FP8_CACHE=is_fp8_cache(cache),
    )


def mla_cache_write_reference(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    cache = latent_cache.view(-1, latent_cache.shape[-1])
    valid = slot_mapping[: latent.shape[0]] >= 0
    rows = torch.cat((latent, k_pe), dim=-1)[valid]
    cache[slot_mapping[: latent.shape[0]][valid]] = quantize_kv(rows, cache.dtype, kv_scale)
