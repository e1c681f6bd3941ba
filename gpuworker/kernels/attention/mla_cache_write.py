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

from gpuworker.kernels.launch import lazy_jit


def _mla_cache_write_kernel(
    latent_ptr,  # [T, R]
    k_pe_ptr,  # [T, E]
    cache_ptr,  # [slots, R + E]
    slot_mapping_ptr,  # [T] int64
    stride_latent,
    stride_k_pe,
    stride_cache,
    KV_RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        e = tl.arange(0, BLOCK_E)
        row = cache_ptr + slot * stride_cache
        latent = tl.load(latent_ptr + t * stride_latent + r, mask=r < KV_RANK)
        tl.store(row + r, latent.to(cache_ptr.dtype.element_ty), mask=r < KV_RANK)
        k_pe = tl.load(k_pe_ptr + t * stride_k_pe + e, mask=e < ROPE)
        tl.store(row + KV_RANK + e, k_pe.to(cache_ptr.dtype.element_ty), mask=e < ROPE)


_mla_cache_write = lazy_jit(_mla_cache_write_kernel, do_not_specialize=("slot_mapping_ptr",))


def mla_cache_write(
    latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """latent [T, R], k_pe [T, E] -> latent_cache (any view whose last dim is R + E and whose rows
    are slots) at slot_mapping [T]; slots < 0 are skipped."""
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
        latent.stride(0),
        k_pe.stride(0),
        cache.stride(0),
        KV_RANK=kv_rank,
        ROPE=rope,
        BLOCK_R=triton.next_power_of_2(kv_rank),
        BLOCK_E=triton.next_power_of_2(rope),
    )


def mla_cache_write_reference(
    latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    cache = latent_cache.view(-1, latent_cache.shape[-1])
    valid = slot_mapping[: latent.shape[0]] >= 0
    cache[slot_mapping[: latent.shape[0]][valid]] = torch.cat((latent, k_pe), dim=-1)[valid].to(cache.dtype)
