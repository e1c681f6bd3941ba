"""The attention kernels' sliding window (WINDOW constexpr) against the torch references: the decode
kernel (split or not, merged in the launch or by the merge kernel, with the step's new token) and the
prefill kernel (fresh prompts and chunks after a cached prefix), with windows shorter than, equal to
and longer than the contexts. Blocks before the window are poisoned with NaN: they must never be read.
"""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.attention.paged_decode import paged_decode_attention, paged_decode_attention_reference
from gpuworker.kernels.attention.prefill import prefill_attention, prefill_attention_reference

ON_CUDA = torch.cuda.is_available()
NUM_Q_HEADS, HEAD_DIM = (32, 128) if ON_CUDA else (4, 32)
NUM_KV_HEADS = NUM_Q_HEADS // 2
BLOCK_SIZE = 16
TILE = {} if ON_CUDA else {"block_n": 16}
PREFILL_TILE = {} if ON_CUDA else {"block_m": 16, "block_n": 16}
SEQ_LENS = [1, 7, 21, 40, 90, 133]
WINDOWS = [1, 21, 50, 1000]


def _poison_before_window(kv_cache, block_tables, first_positions):
    """Point every table entry wholly before each sequence's first visible position at a block full of
    NaN, as a sliding layer's pool leaves them stale."""
    poison = kv_cache.shape[1] - 1
    kv_cache[:, poison] = float("nan")
    for i, first in enumerate(first_positions):
        block_tables[i, : first // BLOCK_SIZE] = poison


@pytest.fixture
def windowed_cache(paged_cache, generator):
    def build(seq_lens, dtype):
        kv_cache, block_tables = paged_cache(seq_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, generator)
        # One spare block at the end of the pool for the poison.
        spare = torch.zeros_like(kv_cache[:, :1])
        return torch.cat([kv_cache, spare], dim=1).contiguous(), block_tables.clone()

    return build


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("num_splits", "merge_in_launch"), [(1, False), (3, False), (3, True)])
def test_decode_window_matches_reference(
    window, num_splits, merge_in_launch, windowed_cache, device, generator, tolerance
):
    dtype = torch.float32
    kv_cache, block_tables = windowed_cache(SEQ_LENS, dtype)
    _poison_before_window(kv_cache, block_tables, [max(0, n - window) for n in SEQ_LENS])
    query = torch.randn(len(SEQ_LENS), NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    out = paged_decode_attention(
        query,
        kv_cache,
        block_tables,
        lens,
        scale,
        max(SEQ_LENS),
        num_splits=num_splits,
        merge_in_launch=merge_in_launch,
        window=window,
        **TILE,
    )
    expected = paged_decode_attention_reference(query, kv_cache, block_tables, lens, scale, window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def test_decode_window_differs_from_full_attention(windowed_cache, device, generator):
    kv_cache, block_tables = windowed_cache(SEQ_LENS, torch.float32)
    query = torch.randn(len(SEQ_LENS), NUM_Q_HEADS, HEAD_DIM, generator=generator).to(device)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    full = paged_decode_attention(query, kv_cache, block_tables, lens, 0.2, max(SEQ_LENS), **TILE)
    windowed = paged_decode_attention(query, kv_cache, block_tables, lens, 0.2, max(SEQ_LENS), window=21, **TILE)
    longer = [i for i, n in enumerate(SEQ_LENS) if n > 21]
    shorter = [i for i, n in enumerate(SEQ_LENS) if n <= 21]
    assert not torch.allclose(full[longer], windowed[longer])
    torch.testing.assert_close(full[shorter], windowed[shorter])


# (new tokens, context incl. them): fresh prompts and chunks after a cached prefix.
CHUNKS = [(37, 37), (1, 20), (25, 70), (16, 16), (3, 50), (40, 133)]


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_window_matches_reference(window, windowed_cache, device, generator, tolerance):
    dtype = torch.float32
    q_lens, seq_lens = [q for q, _ in CHUNKS], [s for _, s in CHUNKS]
    kv_cache, block_tables = windowed_cache(seq_lens, dtype)
    _poison_before_window(kv_cache, block_tables, [max(0, s - q - window + 1) for q, s in CHUNKS])
    query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    out = prefill_attention(query, kv_cache, qsl, lens, block_tables, scale, max(q_lens), window=window, **PREFILL_TILE)
    expected = prefill_attention_reference(query, kv_cache, qsl, lens, block_tables, scale, window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def test_window_must_be_a_non_negative_integer(windowed_cache, device):
    kv_cache, block_tables = windowed_cache([5], torch.float32)
    query = torch.zeros(1, NUM_Q_HEADS, HEAD_DIM, device=device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(query, kv_cache, block_tables, lens, 1.0, 5, window=-1)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="window"):
        prefill_attention(query, kv_cache, qsl, lens, block_tables, 1.0, 1, window=2.5)


@pytest.mark.parametrize(("num_splits", "merge_in_launch"), [(1, False), (3, False), (3, True)])
def test_decode_window_with_the_new_token_in_the_launch(
    num_splits, merge_in_launch, windowed_cache, device, generator, tolerance
):
    # The step's token arrives unrotated and uncached, as the Triton backend hands decodes over.
    from tests.kernels.test_paged_decode_attention import _new_tokens

    window, dtype = 21, torch.float32
    kv_cache, block_tables = windowed_cache(SEQ_LENS, dtype)
    _poison_before_window(kv_cache, block_tables, [max(0, n - window) for n in SEQ_LENS])
    query, new = _new_tokens(SEQ_LENS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, block_tables, generator, device)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    reference_cache = kv_cache.clone()
    scale = HEAD_DIM**-0.5
    expected = paged_decode_attention_reference(
        query, reference_cache, block_tables, lens, scale, new_tokens=new, window=window
    )
    out = paged_decode_attention(
        query,
        kv_cache,
        block_tables,
        lens,
        scale,
        max(SEQ_LENS),
        num_splits=num_splits,
        merge_in_launch=merge_in_launch,
        new_tokens=new,
        window=window,
        **TILE,
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **tolerance(dtype))
