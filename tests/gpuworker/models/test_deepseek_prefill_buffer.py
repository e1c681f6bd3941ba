"""The batched MLA prefill's transient buffer: what a group of sequences' expansion really allocates
(measured by torch's profiler on the CPU, DeepSeek-V2-Lite's shapes) stays within the bytes
models.deepseek.prefill_buffer gives for its rows, and the largest group a step can cut is what the
engine's sizing sets aside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from gpuworker.attention.backend import AttentionMetadata
from gpuworker.engine.sizing import mla_prefill_bytes
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE
from gpuworker.models.config import ModelConfig
from gpuworker.models.deepseek import prefill_buffer
from gpuworker.models.deepseek.attention import MLAttention
from gpuworker.models.deepseek.rotary import DeepseekRotary

ROOT = Path(__file__).resolve().parents[3]
BLOCK_SIZE = 16
V2_LITE = ModelConfig.from_hf(json.loads((ROOT / "bench/configs/deepseek-v2-lite/config.json").read_text()))
# Per context row in bf16: an int64 slot, the gathered 576-value latent row and its expansion into
# 16 heads x (128 + 128) keys and values.
V2_LITE_ROW_BYTES = 8 + (576 + 16 * 256) * 2


@pytest.fixture(scope="module")
def attention() -> MLAttention:
    torch.manual_seed(0)
    layer = MLAttention(V2_LITE, DeepseekRotary(V2_LITE.mla, 64)).to(torch.bfloat16)
    return layer.eval()


def metadata(seq_lens: list[int], query_lens: list[int], num_decode: int) -> AttentionMetadata:
    """A step's metadata: each sequence's blocks back to back in the cache."""
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.arange(start, start + count)
        start += count
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(query_start[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        num_decode_seqs=num_decode,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
    )


def peak_bytes(fn) -> int:
    """The most bytes fn's allocations held at once (the CPU allocator's events, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    del result
    return peak


def gemm_scratch(attention: MLAttention, rows: int) -> int:
    """What the CPU's GEMM of kv_b_proj over `rows` latent rows allocates beside its output: a
    packing buffer of its BLAS, up to ~2 MiB (cuBLAS's workspace on a GPU is allocated once, before
    the pool is sized, not per step)."""
    mla = V2_LITE.mla
    latent = torch.zeros(rows, mla.cache_width, dtype=torch.bfloat16)[:, : mla.kv_lora_rank]
    output = rows * prefill_buffer.expanded_width(mla, V2_LITE.num_heads) * 2
    return peak_bytes(lambda: attention.kv_b_proj(latent)) - output


def test_v2_lite_row_bytes_and_group_rows():
    mla, heads = V2_LITE.mla, V2_LITE.num_heads
    assert prefill_buffer.row_bytes(mla, heads, 2, 2) == V2_LITE_ROW_BYTES
    assert prefill_buffer.group_rows(mla, heads) == 65536  # 2^28 values / (16 x 256)
    # An FP8 cache widens through float32 first, but the expansion is still the larger moment.
    assert prefill_buffer.row_bytes(mla, heads, 2, 1) == V2_LITE_ROW_BYTES


@pytest.mark.parametrize(
    ("max_model_len", "max_num_seqs", "tokens", "rows"),
    [
        (163840, 256, 8192, 163840),  # one sequence at the default context, alone in its group
        (4096, 256, 8192, 65536),  # many shorter prefills: a full group
        (4096, 4, 8192, 4 * 4096),  # never more than every sequence at max_model_len
        (4096, 256, 2, 2 * 4096),  # ... nor more prefills than the step has tokens
    ],
)
def test_sizing_sets_aside_the_largest_group_a_step_can_cut(max_model_len, max_num_seqs, tokens, rows):
    reserved = mla_prefill_bytes(
        V2_LITE,
        element_size=2,
        kv_element_size=2,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=tokens,
    )
    # and each sequence's cu_seqlens_k entry
    assert reserved == rows * V2_LITE_ROW_BYTES + (min(max_num_seqs, tokens) + 1) * 12


COMPOSITIONS = [
    # (context lengths, new tokens per sequence, decodes first)
    ([300], [300], 0),  # one whole prompt
    ([40, 17, 900, 1300], [1, 1, 900, 200], 2),  # decodes, a prompt and a chunk after its prefix
    ([513, 64, 1024, 5, 700], [13, 64, 24, 5, 700], 0),  # chunks after prefix-cache hits
]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("group_values", [None, 600 * 4096], ids=["one-group", "groups-of-600-rows"])
@pytest.mark.parametrize(("seq_lens", "query_lens", "num_decode"), COMPOSITIONS)
def test_a_groups_expansion_allocates_no_more_than_its_rows_bytes(
    attention, monkeypatch, cache_dtype, group_values, seq_lens, query_lens, num_decode
):
    """Each group the prefill cuts (the same context_groups and group_rows it uses), expanded as
    the prefill expands it: the peak the allocator saw is row_bytes x its rows (beside the CPU
    GEMM's own scratch and a few bytes per sequence), and its rows are within the sizing's largest
    group."""
    if group_values is not None:
        monkeypatch.setattr(prefill_buffer, "EXPANDED_VALUES_PER_GROUP", group_values)
    mla, heads = V2_LITE.mla, V2_LITE.num_heads
    meta = metadata(seq_lens, query_lens, num_decode)
    num_blocks = int(meta.block_tables.max()) + 1
    cache = (torch.randn(num_blocks, BLOCK_SIZE, mla.cache_width) / 4).to(cache_dtype)  # the layer's view
    element = 2 if cache_dtype == torch.bfloat16 else 1
    per_row = prefill_buffer.row_bytes(mla, heads, 2, element)
    largest = prefill_buffer.largest_group_rows(
        mla, heads, max_model_len=max(seq_lens), max_num_seqs=len(seq_lens), max_num_batched_tokens=sum(query_lens)
    )
    groups = prefill_buffer.context_groups(seq_lens, num_decode, len(seq_lens), prefill_buffer.group_rows(mla, heads))
    with torch.no_grad():
        for first, last in groups:
            rows = sum(seq_lens[first:last])
            peak = peak_bytes(lambda: attention.expand_group(cache, meta, first, last, torch.bfloat16))
            # Beyond its rows: the group's cu_seqlens_k, an int32 and its int64 sum per sequence.
            beyond = peak - gemm_scratch(attention, rows) - rows * per_row
            assert 0 <= beyond <= prefill_buffer.SEQ_BYTES * (last - first + 1), (first, last)
            assert rows <= largest
