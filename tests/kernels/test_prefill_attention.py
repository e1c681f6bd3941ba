"""prefill_attention against its torch reference: ragged chunks, cached prefixes, GQA, dtypes, blocks."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.attention.prefill import prefill_attention, prefill_attention_reference

ON_CUDA = torch.cuda.is_available()
DTYPES, BLOCK_SIZES, GQA_RATIOS = (torch.float32, torch.float16, torch.bfloat16), (16, 32), (1, 2, 4)
# The GPU runs every combination; the interpreter a covering subset (each dtype with both block
# sizes, each GQA ratio with two dtypes) to stay fast.
CASES = (
    [(d, b, g) for d in DTYPES for b in BLOCK_SIZES for g in GQA_RATIOS]
    if ON_CUDA
    else [(DTYPES[i // 2], BLOCK_SIZES[i % 2], GQA_RATIOS[i % 3]) for i in range(6)]
)
NUM_Q_HEADS, HEAD_DIM = (32, 128) if ON_CUDA else (4, 32)
# (new tokens, context incl. them): a single token, fresh prompts of odd lengths, chunks after a
# cached prefix (prefix-cache hit or an earlier chunk), one exactly a block long.
CHUNKS = (
    [(1, 1), (700, 700), (1, 900), (513, 1537), (16, 16), (300, 2348), (37, 37)]
    if ON_CUDA
    else [(1, 1), (37, 37), (1, 20), (25, 70), (16, 16), (3, 50)]
)
# Small tiles in the interpreter so short chunks still cross several tiles and the diagonal.
TILES = {} if ON_CUDA else {"block_m": 16, "block_n": 16}


@pytest.fixture
def prefill(paged_cache, device, generator):
    def run(dtype, block_size, num_kv_heads, chunks, *, row_offset=0, spans=(), **kwargs):
        q_lens = [q for q, _ in chunks]
        seq_lens = [s for _, s in chunks]
        kv_cache, block_tables = paged_cache(seq_lens, num_kv_heads, HEAD_DIM, block_size, dtype, generator)
        num_rows = row_offset + sum(q_lens) + 2  # rows outside every chunk before and after
        query = torch.randn(num_rows, NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
        starts = [row_offset]
        for q in q_lens:
            starts.append(starts[-1] + q)
        query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        scale = HEAD_DIM**-0.5
        if spans:  # (chunk, first row in it, length): rows that see to the span's last position
            ends = torch.zeros(num_rows, dtype=torch.int32)
            for (q, s), start in zip(chunks, starts, strict=False):
                ends[start : start + q] = torch.arange(s - q, s)
            for chunk, first, length in spans:
                row = starts[chunk] + first
                ends[row : row + length] = ends[row + length - 1]
            kwargs["span_ends"] = ends.to(device)
        out = torch.full_like(query, float("nan"))
        prefill_attention(
            query, kv_cache, query_start_loc, lens, block_tables, scale, max(q_lens), out=out, **{**TILES, **kwargs}
        )
        expected = torch.full_like(query, float("nan"))
        masks = {k: v for k, v in kwargs.items() if k in ("window", "span_ends")}
        prefill_attention_reference(query, kv_cache, query_start_loc, lens, block_tables, scale, out=expected, **masks)
        return out, expected, starts

    return run


@pytest.mark.parametrize(("dtype", "block_size", "gqa"), CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_matches_reference(dtype, block_size, gqa, prefill, tolerance):
    out, expected, starts = prefill(dtype, block_size, NUM_Q_HEADS // gqa, CHUNKS)
    inside = slice(starts[0], starts[-1])
    torch.testing.assert_close(out[inside], expected[inside], **tolerance(dtype))
    # Rows outside every chunk are left untouched.
    assert out[starts[-1] :].isnan().all()


def test_query_start_loc_may_start_past_row_zero(prefill, tolerance):
    # The backend hands the prefill part of a mixed batch over as a slice of query_start_loc.
    out, expected, starts = prefill(torch.bfloat16, 16, NUM_Q_HEADS // 4, CHUNKS[1:4], row_offset=5)
    assert out[:5].isnan().all()
    torch.testing.assert_close(out[5 : starts[-1]], expected[5 : starts[-1]], **tolerance(torch.bfloat16))


@pytest.mark.parametrize("window", [0, 9])
def test_rows_in_a_span_see_to_its_end(prefill, tolerance, generator, window):
    # Spans at a chunk's start, in its middle across tiles, ending on its last row, a whole chunk,
    # and one longer than the window; the other rows stay causal.
    chunks = [(37, 37), (25, 70), (3, 50)]
    spans = [(0, 5, 12), (0, 20, 17), (1, 0, 10), (1, 20, 5), (2, 0, 3)]
    out, expected, starts = prefill(torch.float32, 16, NUM_Q_HEADS // 2, chunks, spans=spans, window=window)
    torch.testing.assert_close(out[: starts[-1]], expected[: starts[-1]], **tolerance(torch.float32))
    generator.manual_seed(1234)  # the same cache and queries, every row causal
    causal, _, _ = prefill(torch.float32, 16, NUM_Q_HEADS // 2, chunks, window=window)
    assert not torch.allclose(out[5:17], causal[5:17])  # the spans change what their rows see
    torch.testing.assert_close(out[:5], causal[:5])


@pytest.mark.skipif(ON_CUDA, reason="the default tiles are what the GPU cases use")
def test_default_tiles(prefill, tolerance):
    out, expected, starts = prefill(
        torch.float32, 16, NUM_Q_HEADS // 2, [(150, 200), (3, 3)], block_m=None, block_n=None
    )
    torch.testing.assert_close(out[: starts[-1]], expected[: starts[-1]], **tolerance(torch.float32))


def test_rejects_bad_arguments(device):
    query = torch.zeros(6, 4, 16, device=device)
    cache = torch.zeros(2, 3, 16, 2, 16, device=device)
    tables = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.full((2,), 3, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3, 6], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \(3,\)"):
        prefill_attention(query, cache, qsl[:2], lens, tables, 1.0, 3)
    with pytest.raises(ValueError, match="block_tables has 1 rows"):
        prefill_attention(query, cache, qsl, lens, tables[:1], 1.0, 3)
    with pytest.raises(ValueError, match="query_start_loc must have dtype"):
        prefill_attention(query, cache, qsl.float(), lens, tables, 1.0, 3)
    with pytest.raises(ValueError, match="max_query_len must be a non-negative host int"):
        prefill_attention(query, cache, qsl, lens, tables, 1.0, None)
    with pytest.raises(ValueError, match="kv_cache head_dim 16 does not match query head_dim 8"):
        prefill_attention(torch.zeros(6, 4, 8, device=device), cache, qsl, lens, tables, 1.0, 3)
