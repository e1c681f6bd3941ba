"""kv_cache_write against its torch reference: exact copies through the slot mapping, padding skipped."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.attention.kv_cache_write import kv_cache_write, kv_cache_write_reference

ON_CUDA = torch.cuda.is_available()
# (num_tokens, num_kv_heads, head_dim, num_blocks)
SHAPE = (3000, 8, 128, 400) if ON_CUDA else (13, 2, 16, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference_with_padding_and_strided_views(dtype, block_size, device, generator):
    num_tokens, num_kv_heads, head_dim, num_blocks = SHAPE
    num_slots = num_blocks * block_size
    # k and v as the model produces them: column slices of one fused qkv row, not contiguous.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=generator).to(dtype).to(device)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < 0.2] = -1  # padding tokens
    slots[-1] = num_slots - 1  # the very last slot of the cache
    slot_mapping = slots.to(device)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype).to(device)
    expected = cache.clone()

    kv_cache_write(key, value, cache, slot_mapping)
    kv_cache_write_reference(key, value, expected, slot_mapping)

    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_casts_to_cache_dtype_and_accepts_int32_slots(slot_dtype, device, generator):
    key = torch.randn(5, 2, 16, generator=generator).bfloat16().to(device)
    value = torch.randn(5, 2, 16, generator=generator).bfloat16().to(device)
    cache = torch.zeros(2, 4, 16, 2, 16, dtype=torch.float32, device=device)
    expected = cache.clone()
    slot_mapping = torch.tensor([3, -1, 17, 63, 0], dtype=slot_dtype, device=device)

    kv_cache_write(key, value, cache, slot_mapping)
    kv_cache_write_reference(key, value, expected, slot_mapping)

    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_all_padding_writes_nothing(device, generator):
    key = torch.randn(4, 2, 16, generator=generator).to(device)
    cache = torch.randn(2, 3, 16, 2, 16, generator=generator).to(device)
    before = cache.clone()
    kv_cache_write(key, key.clone(), cache, torch.full((4,), -1, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


def test_rejects_bad_arguments(device):
    key = torch.zeros(4, 2, 16, device=device)
    cache = torch.zeros(2, 3, 16, 2, 16, device=device)
    slots = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="value must have shape"):
        kv_cache_write(key, torch.zeros(4, 2, 8, device=device), cache, slots)
    with pytest.raises(ValueError, match="kv_cache holds 2 kv heads of dim 16, but key has 4 heads"):
        kv_cache_write(torch.zeros(4, 4, 16, device=device), torch.zeros(4, 4, 16, device=device), cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        kv_cache_write(key, key, cache, slots.float())
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \(4,\)"):
        kv_cache_write(key, key, cache, slots[:3])
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        kv_cache_write(key, key, torch.zeros(3, 3, 16, 2, 16, device=device), slots)
    with pytest.raises(ValueError, match="key must be contiguous in its last dimension"):
        kv_cache_write(torch.zeros(4, 16, 2, device=device).transpose(1, 2), key, cache, slots)


@pytest.mark.skipif(ON_CUDA, reason="CPU tensors are only refused where there is no interpreter fallback")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    key = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        kv_cache_write(key, key, torch.zeros(2, 3, 16, 2, 16), torch.zeros(4, dtype=torch.int64))
