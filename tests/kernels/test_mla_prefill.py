"""The Triton MLA prefill kernel against its float32 torch reference over ragged batches: chunks at
the end of longer contexts (earlier chunks, prefix-cache hits), empty chunks, the rotary key shared
by the heads or per head, DeepSeek's head dims (192 = 128 + 64 for keys, 128 for values) and small
ones, float32 and bfloat16; on Triton's CPU interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.attention.mla_prefill import (
    MLAPrefillConfig,
    mla_prefill_attention,
    mla_prefill_attention_reference,
)
from tests.kernels.conftest import DEVICE, TOLERANCES


def _cumulative(lengths: list[int], start: int = 0) -> list[int]:
    offsets = [start]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def _batch(q_lens, seq_lens, heads, nope, rope, v_dim, dtype, seed, shared_rope=True, first_row=0):
    generator = torch.Generator().manual_seed(seed)
    num_tokens, context = first_row + sum(q_lens), sum(seq_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    q = rand(num_tokens, heads, nope + rope)
    q_nope, q_rope = q.split([nope, rope], dim=-1)  # strided views, as the model's are
    kv = rand(context, heads, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k_rope = rand(context, 1, rope).expand(-1, heads, -1) if shared_rope else rand(context, heads, rope)
    cu_q, cu_k = _cumulative(q_lens, first_row), _cumulative(seq_lens)
    return q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k


CASES = [
    # (q_lens, seq_lens): whole prompts, chunks after cached prefixes, one-token chunks, an empty one
    ([5, 1, 37], [5, 40, 37]),
    ([1, 0, 20, 3], [1, 9, 150, 3]),
    ([70], [300]),
    ([16, 33], [16, 97]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nope, rope, v_dim", [(128, 64, 128), (64, 32, 64), (48, 16, 40)])
@pytest.mark.parametrize("q_lens, seq_lens", CASES)
def test_mla_prefill_matches_reference(q_lens, seq_lens, nope, rope, v_dim, dtype):
    heads = 3
    q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k = _batch(
        q_lens, seq_lens, heads, nope, rope, v_dim, dtype, seed=sum(seq_lens) + nope
    )
    config = MLAPrefillConfig(block_m=16, block_n=16) if dtype != torch.float32 else None
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=DEVICE)
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=DEVICE)
    out = mla_prefill_attention(q_nope, q_rope, k_nope, k_rope, v, cu_q_t, cu_k_t, max(q_lens), 0.07, config=config)
    expected = mla_prefill_attention_reference(q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k, 0.07)
    assert out.shape == (sum(q_lens), heads, v_dim) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_per_head_rope_keys_and_rows_outside_the_chunks_untouched():
    """cu_seqlens_q starting past 0 (the prefill part of a mixed batch): the rows before it keep what
    `out` held; rotary keys per head (no broadcast) are read per head."""
    q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k = _batch(
        [4, 9], [30, 9], 2, 32, 16, 32, torch.float32, seed=3, shared_rope=False, first_row=3
    )
    out = torch.full((16, 2, 32), 7.0, device=DEVICE)
    cu_q_t = torch.tensor(cu_q, device=DEVICE)
    cu_k_t = torch.tensor(cu_k, device=DEVICE)
    mla_prefill_attention(q_nope, q_rope, k_nope, k_rope, v, cu_q_t, cu_k_t, 9, 0.2, out=out)
    expected = mla_prefill_attention_reference(q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k, 0.2)
    assert torch.equal(out[:3], torch.full((3, 2, 32), 7.0, device=DEVICE))
    torch.testing.assert_close(out[3:], expected[3:], **TOLERANCES[torch.float32])


def test_the_reference_is_causal_attention_at_the_end_of_the_context():
    """The reference itself against SDPA over one sequence with the mask offset by the prefix."""
    q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k = _batch([6], [20], 2, 8, 8, 8, torch.float32, seed=1)
    out = mla_prefill_attention_reference(q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k, 0.3)
    query = torch.cat((q_nope, q_rope), -1).transpose(0, 1)
    keys = torch.cat((k_nope, k_rope), -1).transpose(0, 1)
    mask = torch.arange(20, device=DEVICE)[None, :] <= torch.arange(14, 20, device=DEVICE)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, v.transpose(0, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(out, expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "k_nope": a["k_nope"][:, :1]}, "k_nope must have shape"),
        (lambda a: {**a, "v": a["v"].to(torch.float16)}, "v must have dtype"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:1]}, "must count the same sequences"),
        (lambda a: {**a, "q_nope": a["q_nope"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
        (lambda a: {**a, "max_query_len": -1}, "max_query_len"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].float()}, "cu_seqlens_q must have dtype"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(change, message):
    q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k = _batch([2, 3], [2, 5], 2, 16, 16, 16, torch.float32, seed=2)
    args = {
        "q_nope": q_nope,
        "q_rope": q_rope,
        "k_nope": k_nope,
        "k_rope": k_rope,
        "v": v,
        "cu_seqlens_q": torch.tensor(cu_q, device=DEVICE),
        "cu_seqlens_k": torch.tensor(cu_k, device=DEVICE),
        "max_query_len": 3,
        "scale": 0.1,
    }
    with pytest.raises(ValueError, match=message):
        mla_prefill_attention(**change(args))
