"""Packed bidirectional attention (kernels/encoder_attention.py) against its torch reference, under
the Triton interpreter on CPU and compiled on a GPU."""

import pytest
import torch

from gpuworker.kernels.attention.encoder import encoder_attention, encoder_attention_reference

ON_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 24])
def test_each_sequence_attends_to_itself_only(dtype, head_dim, device, generator):
    # Lengths across tile edges (1, 31/32/33, 70), on views of one fused QKV projection as the encoder passes them.
    lengths = [1, 33, 7, 70, 32] if not ON_CUDA else [1, 33, 7, 70, 32, 512, 129]
    heads = 3
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=generator).to(dtype).to(device)
    q, k, v = qkv.unbind(1)

    out = encoder_attention(q, k, v, cu_seqlens, max(lengths), head_dim**-0.5)

    expected = encoder_attention_reference(q.float(), k.float(), v.float(), cu_seqlens, max(lengths), head_dim**-0.5)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), expected, **tolerance)
    # A sequence alone gives what it gives packed beside the others.
    first = lengths[0] + lengths[1]
    alone = encoder_attention(
        q[lengths[0] : first],
        k[lengths[0] : first],
        v[lengths[0] : first],
        torch.tensor([0, lengths[1]], dtype=torch.int32, device=device),
        lengths[1],
        head_dim**-0.5,
    )
    torch.testing.assert_close(alone, out[lengths[0] : first])


def test_the_reference_equals_attention_per_sequence(generator):
    lengths = [4, 1, 9]
    cu_seqlens = torch.tensor([0, 4, 5, 14], dtype=torch.int32)
    q, k, v = torch.randn(3, 14, 2, 8, generator=generator).unbind(0)
    out = encoder_attention_reference(q, k, v, cu_seqlens, max(lengths), 0.3)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * 0.3
        torch.testing.assert_close(out[start:end], torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[start:end]))


def test_bad_arguments_are_value_errors(device):
    q = torch.zeros(4, 2, 8, device=device)
    cu_seqlens = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k must have shape"):
        encoder_attention(q, q[:3], q, cu_seqlens, 4, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        encoder_attention(q, q.half(), q, cu_seqlens, 4, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        encoder_attention(q, q, q, cu_seqlens.float(), 4, 1.0)
    with pytest.raises(ValueError, match="max_seqlen"):
        encoder_attention(q, q, q, cu_seqlens, -1, 1.0)
