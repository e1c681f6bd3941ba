"""apply_rotary against its torch reference and the model's RotaryEmbedding (same cache layout), and
apply_rotary_and_cache against apply_rotary followed by kv_cache_write (bit for bit)."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.attention.kv_cache_write import kv_cache_write
from gpuworker.kernels.attention.rotary import (
    apply_rotary,
    apply_rotary_and_cache,
    apply_rotary_and_cache_reference,
    apply_rotary_reference,
)
from gpuworker.kernels.norm.qk_norm import QKNorm
from gpuworker.kernels.norm.rms_norm import rms_norm
from gpuworker.models.layers import RotaryEmbedding

ON_CUDA = torch.cuda.is_available()
NUM_TOKENS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_POS = (2000, 32, 8, 128, 8192) if ON_CUDA else (9, 4, 2, 32, 64)


def _fused_qkv(dtype, device, generator, head_dim=HEAD_DIM, with_value=False):
    """q and k (and v) as strided views of one fused projection, as the model hands them over."""
    q_size, kv_size = NUM_Q_HEADS * head_dim, NUM_KV_HEADS * head_dim
    qkv = torch.randn(NUM_TOKENS, q_size + 2 * kv_size, generator=generator).to(dtype).to(device)
    query = qkv[:, :q_size].view(NUM_TOKENS, NUM_Q_HEADS, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(NUM_TOKENS, NUM_KV_HEADS, head_dim)
    if with_value:
        return qkv, query, key, qkv[:, q_size + kv_size :].view(NUM_TOKENS, NUM_KV_HEADS, head_dim)
    return qkv, query, key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
)
def test_matches_model_rotary_in_place(dtype, rope_scaling, device, generator, tolerance):
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 500000.0, rope_scaling).to(device)
    qkv, query, key = _fused_qkv(dtype, device, generator)
    positions = torch.randint(0, MAX_POS, (NUM_TOKENS,), generator=generator).to(device)
    positions[0] = MAX_POS - 1
    v_before = qkv[:, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM :].clone()
    expected_q, expected_k = rotary(positions, query.clone(), key.clone())

    got_q, got_k = apply_rotary(positions, query, key, rotary.cos_cache, rotary.sin_cache)

    assert got_q is query and got_k is key
    torch.testing.assert_close(query, expected_q, **tolerance(dtype))
    torch.testing.assert_close(key, expected_k, **tolerance(dtype))
    assert torch.equal(qkv[:, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM :], v_before)  # v untouched


def test_partial_rotary_leaves_the_tail(device, generator, tolerance):
    _, query, key = _fused_qkv(torch.float16, device, generator)
    rot_dim = HEAD_DIM // 2
    freqs = torch.arange(MAX_POS).float()[:, None] * torch.rand(rot_dim // 2, generator=generator)[None, :]
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    positions = torch.randint(0, MAX_POS, (NUM_TOKENS,), generator=generator).to(device)
    expected_q, expected_k = apply_rotary_reference(positions, query, key, cos, sin)
    apply_rotary(positions, query, key, cos, sin)
    torch.testing.assert_close(query, expected_q, **tolerance(torch.float16))
    torch.testing.assert_close(key, expected_k, **tolerance(torch.float16))


def test_rejects_bad_arguments(device):
    q, k = torch.zeros(3, 4, 16, device=device), torch.zeros(3, 2, 16, device=device)
    cos = torch.zeros(10, 8, device=device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"positions must have shape \(3,\)"):
        apply_rotary(pos[:2], q, k, cos, cos)
    with pytest.raises(ValueError, match="key must have shape"):
        apply_rotary(pos, q, torch.zeros(3, 2, 8, device=device), cos, cos)
    with pytest.raises(ValueError, match="cos_cache's width 9"):
        apply_rotary(pos, q, k, torch.zeros(10, 9, device=device), torch.zeros(10, 9, device=device))
    with pytest.raises(ValueError, match="key must have dtype"):
        apply_rotary(pos, q, k.half(), cos, cos)


def _qk_norm(dtype, device, generator, head_dim=HEAD_DIM):
    """Qwen3-like norm weights: around 1, not all equal, so a missed or swapped weight shows."""
    weights = (1.0 + 0.5 * torch.randn(2, head_dim, generator=generator)).to(dtype).to(device)
    return QKNorm(weights[0], weights[1], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_qk_norm_then_rotary_in_one_launch(dtype, device, generator, tolerance):
    # Qwen3: each head of q and k RMS-normalised with its own weight, then rotated; against the model's
    # two steps (the rms_norm kernel on each, then apply_rotary) and the torch reference.
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 1000000.0, None).to(device)
    qkv, query, key = _fused_qkv(dtype, device, generator)
    qkv.mul_(3.0)  # rms far from 1, so a missing norm shows
    norm = _qk_norm(dtype, device, generator)
    positions = torch.randint(0, MAX_POS, (NUM_TOKENS,), generator=generator).to(device)
    v_before = qkv[:, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM :].clone()
    two_q = rms_norm(query, norm.q_weight, norm.eps)
    two_k = rms_norm(key, norm.k_weight, norm.eps)
    apply_rotary(positions, two_q, two_k, rotary.cos_cache, rotary.sin_cache)
    expected_q, expected_k = apply_rotary_reference(positions, query, key, rotary.cos_cache, rotary.sin_cache, norm)
    unnormed_q = apply_rotary_reference(positions, query, key, rotary.cos_cache, rotary.sin_cache)[0]

    apply_rotary(positions, query, key, rotary.cos_cache, rotary.sin_cache, qk_norm=norm)

    for got, two_step, expected in ((query, two_q, expected_q), (key, two_k, expected_k)):
        torch.testing.assert_close(got, expected, **tolerance(dtype))
        torch.testing.assert_close(got, two_step, **tolerance(dtype))
    assert torch.equal(qkv[:, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM :], v_before)
    # Without the norm the heads keep their rms of about 3: the comparisons above see the norm.
    assert not torch.allclose(expected_q.float(), unnormed_q.float(), atol=0.5)


def test_qk_norm_rejects_bad_arguments(device):
    q, k = torch.zeros(3, 4, 16, device=device), torch.zeros(3, 2, 16, device=device)
    cos = torch.zeros(10, 8, device=device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    weight = torch.ones(16, device=device)
    with pytest.raises(ValueError, match="qk_norm needs rotary over the whole head: cos_cache's width 4"):
        apply_rotary(pos, q, k, cos[:, :4], cos[:, :4], qk_norm=QKNorm(weight, weight, 1e-6))
    with pytest.raises(ValueError, match=r"qk_norm.k_weight must have shape \(16,\)"):
        apply_rotary(pos, q, k, cos, cos, qk_norm=QKNorm(weight, weight[:8], 1e-6))
    with pytest.raises(ValueError, match="qk_norm.q_weight must have dtype"):
        apply_rotary(pos, q, k, cos, cos, qk_norm=QKNorm(weight.half(), weight, 1e-6))
    with pytest.raises(ValueError, match="qk_norm.eps must be > 0"):
        apply_rotary_and_cache(
            pos,
            q,
            k,
            k,
            cos,
            cos,
            torch.zeros(2, 4, 16, 2, 16, device=device),
            pos,
            qk_norm=QKNorm(weight, weight, 0.0),
        )


def _cache_and_slots(dtype, block_size, device, generator):
    """A random cache with room for every token, shuffled slots, about a fifth of them padding (-1)."""
    num_blocks = -(-NUM_TOKENS // block_size) + 2
    cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
    # Distinct slots (the last one is set below): two tokens never race for one slot.
    slots = torch.randperm(num_blocks * block_size - 1, generator=generator)[:NUM_TOKENS]
    slots[torch.rand(NUM_TOKENS, generator=generator) < 0.2] = -1
    slots[0] = -1
    slots[-1] = num_blocks * block_size - 1  # the very last slot of the cache
    return cache, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("rot_dim", [HEAD_DIM, HEAD_DIM // 2], ids=["full", "partial"])
def test_fused_cache_write_is_rotary_then_kv_cache_write(dtype, block_size, rot_dim, device, generator, tolerance):
    qkv, query, key, value = _fused_qkv(dtype, device, generator, with_value=True)  # GQA: 2 q heads per kv head
    freqs = torch.arange(MAX_POS).float()[:, None] * torch.rand(rot_dim // 2, generator=generator)[None, :]
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    positions = torch.randint(0, MAX_POS, (NUM_TOKENS,), generator=generator).to(device)
    cache, slot_mapping = _cache_and_slots(dtype, block_size, device, generator)
    untouched_cache = cache.clone()
    # Today's two launches, on copies.
    two_step_qkv = qkv.clone()
    q2, k2, v2 = (
        two_step_qkv.as_strided(t.shape, t.stride(), t.storage_offset() - qkv.storage_offset())
        for t in (query, key, value)
    )
    two_step_cache = cache.clone()
    apply_rotary(positions, q2, k2, cos, sin)
    kv_cache_write(k2, v2, two_step_cache, slot_mapping)
    reference_cache = cache.clone()
    reference_q = apply_rotary_and_cache_reference(
        positions, query, key, value, cos, sin, reference_cache, slot_mapping
    )
    key_before, value_before = key.clone(), value.clone()

    got = apply_rotary_and_cache(positions, query, key, value, cos, sin, cache, slot_mapping)

    assert got is query
    assert torch.equal(query, q2)
    assert torch.equal(cache, two_step_cache)
    assert torch.equal(key, key_before) and torch.equal(value, value_before)  # keys go to the cache only
    torch.testing.assert_close(query, reference_q, **tolerance(dtype))
    torch.testing.assert_close(cache, reference_cache, **tolerance(dtype))
    padded = slot_mapping < 0
    assert padded.any() and not padded.all()
    written = torch.zeros(cache.shape[1] * block_size, dtype=torch.bool, device=device)
    written[slot_mapping[~padded]] = True
    untouched = ~written.view(cache.shape[1], block_size)
    assert torch.equal(cache[:, untouched], untouched_cache[:, untouched])  # padding wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_cache_write_with_qk_norm(dtype, device, generator, tolerance):
    # The prefill rows' path for Qwen3: norm, rotary and the cache write in one launch, as the
    # normalised heads rotated (apply_rotary with the norm) and then written.
    qkv, query, key, value = _fused_qkv(dtype, device, generator, with_value=True)
    qkv.mul_(3.0)
    norm = _qk_norm(dtype, device, generator)
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 1000000.0, None).to(device)
    positions = torch.randint(0, MAX_POS, (NUM_TOKENS,), generator=generator).to(device)
    cache, slot_mapping = _cache_and_slots(dtype, 16, device, generator)
    two_step = qkv.clone()
    q2, k2, v2 = (
        two_step.as_strided(t.shape, t.stride(), t.storage_offset() - qkv.storage_offset()) for t in (query, key, value)
    )
    two_step_cache, reference_cache = cache.clone(), cache.clone()
    apply_rotary(positions, q2, k2, rotary.cos_cache, rotary.sin_cache, qk_norm=norm)
    kv_cache_write(k2, v2, two_step_cache, slot_mapping)
    reference_q = apply_rotary_and_cache_reference(
        positions, query, key, value, rotary.cos_cache, rotary.sin_cache, reference_cache, slot_mapping, qk_norm=norm
    )
    key_before = key.clone()

    apply_rotary_and_cache(
        positions, query, key, value, rotary.cos_cache, rotary.sin_cache, cache, slot_mapping, qk_norm=norm
    )

    assert torch.equal(query, q2)
    assert torch.equal(cache, two_step_cache)
    assert torch.equal(key, key_before)
    torch.testing.assert_close(query, reference_q, **tolerance(dtype))
    torch.testing.assert_close(cache, reference_cache, **tolerance(dtype))


def test_fused_casts_to_the_cache_dtype(device, generator):
    qkv, query, key, value = _fused_qkv(torch.bfloat16, device, generator, with_value=True)
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, None).to(device)
    positions = torch.randint(0, MAX_POS, (NUM_TOKENS,), generator=generator).to(device)
    cache, slot_mapping = _cache_and_slots(torch.float32, 16, device, generator)
    expected_cache = cache.clone()
    two_step = qkv.clone()
    q2, k2, v2 = (
        two_step.as_strided(t.shape, t.stride(), t.storage_offset() - qkv.storage_offset()) for t in (query, key, value)
    )
    apply_rotary(positions, q2, k2, rotary.cos_cache, rotary.sin_cache)
    kv_cache_write(k2, v2, expected_cache, slot_mapping)
    apply_rotary_and_cache(positions, query, key, value, rotary.cos_cache, rotary.sin_cache, cache, slot_mapping.int())
    assert torch.equal(query, q2)
    assert torch.equal(cache, expected_cache)


def test_fused_rejects_bad_arguments(device):
    q, k = torch.zeros(3, 4, 16, device=device), torch.zeros(3, 2, 16, device=device)
    cos = torch.zeros(10, 8, device=device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    cache = torch.zeros(2, 4, 16, 2, 16, device=device)
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \(3,\)"):
        apply_rotary_and_cache(pos, q, k, k, cos, cos, cache, pos[:2])
    with pytest.raises(ValueError, match="kv_cache holds 2 kv heads of dim 16, but key has 2 heads of dim 8"):
        apply_rotary_and_cache(
            pos,
            torch.zeros(3, 4, 8, device=device),
            torch.zeros(3, 2, 8, device=device),
            torch.zeros(3, 2, 8, device=device),
            torch.zeros(10, 4, device=device),
            torch.zeros(10, 4, device=device),
            cache,
            pos,
        )
    with pytest.raises(ValueError, match="value must have shape"):
        apply_rotary_and_cache(pos, q, k, k[:, :1], cos, cos, cache, pos)
    with pytest.raises(ValueError, match="kv_cache must have 5 dimensions"):
        apply_rotary_and_cache(pos, q, k, k, cos, cos, cache[0], pos)
