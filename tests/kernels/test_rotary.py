"""apply_rotary against its torch reference and the model's RotaryEmbedding (same cache layout)."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.rotary import apply_rotary, apply_rotary_reference
from gpuworker.models.layers import RotaryEmbedding

ON_CUDA = torch.cuda.is_available()
NUM_TOKENS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_POS = (
    (2000, 32, 8, 128, 8192) if ON_CUDA else (9, 4, 2, 32, 64)
)


def _fused_qkv(dtype, device, generator, head_dim=HEAD_DIM):
    """q and k as strided views of one fused projection, as the model hands them over."""
    q_size, kv_size = NUM_Q_HEADS * head_dim, NUM_KV_HEADS * head_dim
    qkv = torch.randn(NUM_TOKENS, q_size + 2 * kv_size, generator=generator).to(dtype).to(device)
    query = qkv[:, :q_size].view(NUM_TOKENS, NUM_Q_HEADS, head_dim)
    key = qkv[:, q_size:q_size + kv_size].view(NUM_TOKENS, NUM_KV_HEADS, head_dim)
    return qkv, query, key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}])
def test_matches_model_rotary_in_place(dtype, rope_scaling, device, generator, tolerance):
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 500000.0, rope_scaling).to(device)
    qkv, query, key = _fused_qkv(dtype, device, generator)
    positions = torch.randint(0, MAX_POS, (NUM_TOKENS,), generator=generator).to(device)
    positions[0] = MAX_POS - 1
    v_before = qkv[:, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM:].clone()
    expected_q, expected_k = rotary(positions, query.clone(), key.clone())

    got_q, got_k = apply_rotary(positions, query, key, rotary.cos_cache, rotary.sin_cache)

    assert got_q is query and got_k is key
    torch.testing.assert_close(query, expected_q, **tolerance(dtype))
    torch.testing.assert_close(key, expected_k, **tolerance(dtype))
    assert torch.equal(qkv[:, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM:], v_before)  # v untouched


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
