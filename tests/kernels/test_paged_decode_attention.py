"""paged_decode_attention against its torch reference over dtypes, block sizes, GQA ratios and splits."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
import triton.language as tl

from gpuworker.kernels.attention.paged_decode import (
    MAX_SPLITS,
    DecodeVariant,
    NewTokens,
    SplitCounters,
    _merge_partitions_kernel,
    _paged_decode_kernel,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from gpuworker.kernels.attention.rotary import apply_rotary_and_cache
from gpuworker.kernels.norm.qk_norm import QKNorm

ON_CUDA = torch.cuda.is_available()
DTYPES, BLOCK_SIZES, GQA_RATIOS = (torch.float32, torch.float16, torch.bfloat16), (16, 32), (1, 2, 4)
# The GPU runs every combination; the interpreter a covering subset (each dtype with both block
# sizes, each GQA ratio with two dtypes) to stay fast.
CASES = (
    [(d, b, g) for d in DTYPES for b in BLOCK_SIZES for g in GQA_RATIOS]
    if ON_CUDA
    else [(DTYPES[i // 2], BLOCK_SIZES[i % 2], GQA_RATIOS[i % 3]) for i in range(6)]
)
# Llama-3-8B on the GPU (32 query heads, head_dim 128); a few small heads in the interpreter.
NUM_Q_HEADS, HEAD_DIM = (32, 128) if ON_CUDA else (4, 64)
# Ragged contexts: length 1, one short of and one past a block, a block multiple, and long ones.
SEQ_LENS = [1, 15, 17, 32, 1000, 4099, 2500, 77] if ON_CUDA else [1, 15, 17, 32, 70]
# Small tiles in the interpreter so a short context still spans several tiles and partitions.
TILE = {} if ON_CUDA else {"block_n": 16}
# A split launch merges its partitions in the launch (large batches) or in a second kernel (small ones).
MERGES = pytest.mark.parametrize("merge_in_launch", [True, False], ids=["merge-in-launch", "merge-kernel"])


@pytest.fixture
def decode(paged_cache, device, generator):
    def run(
        dtype,
        block_size,
        num_kv_heads,
        seq_lens,
        *,
        num_heads=NUM_Q_HEADS,
        head_dim=HEAD_DIM,
        max_seq_len=None,
        table_width=None,
        **kwargs,
    ):
        kv_cache, block_tables = paged_cache(
            seq_lens, num_kv_heads, head_dim, block_size, dtype, generator, table_width=table_width
        )
        query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(dtype).to(device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        scale = head_dim**-0.5
        out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
        max_seq_len = max(seq_lens) if max_seq_len is None else max_seq_len
        result = paged_decode_attention(
            query, kv_cache, block_tables, lens, scale, max_seq_len, out=out, **{**TILE, **kwargs}
        )
        assert result is out
        return out, paged_decode_attention_reference(query, kv_cache, block_tables, lens, scale)

    return run


@pytest.mark.parametrize(("dtype", "block_size", "gqa"), CASES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("num_splits", [1, 3])
@MERGES
def test_matches_reference(dtype, block_size, gqa, num_splits, merge_in_launch, decode, tolerance):
    out, expected = decode(
        dtype, block_size, NUM_Q_HEADS // gqa, SEQ_LENS, num_splits=num_splits, merge_in_launch=merge_in_launch
    )
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_default_splits_from_max_seq_len(dtype, decode, tolerance):
    # One sequence: the launcher splits the context to fill the device.
    seq_lens = [8000] if ON_CUDA else [600]
    out, expected = decode(dtype, 16, NUM_Q_HEADS // 4, seq_lens)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@MERGES
def test_max_seq_len_above_the_contexts_leaves_empty_partitions(merge_in_launch, decode, tolerance):
    # As in a CUDA graph captured for long contexts and replayed on shorter ones: most partitions of
    # most sequences hold no tokens.
    max_seq_len = 4 * max(SEQ_LENS)
    out, expected = decode(
        torch.bfloat16,
        16,
        NUM_Q_HEADS // 2,
        SEQ_LENS,
        max_seq_len=max_seq_len,
        table_width=-(-max_seq_len // 16),
        num_splits=MAX_SPLITS if ON_CUDA else 8,
        merge_in_launch=merge_in_launch,
    )
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))


@MERGES
def test_zero_length_sequence_gets_zeros(merge_in_launch, decode):
    out, expected = decode(
        torch.float32, 16, NUM_Q_HEADS // 2, [0, 5, 0], num_splits=2, merge_in_launch=merge_in_launch
    )
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("head_dim", [80] if not ON_CUDA else [64, 80])
def test_other_head_dims(head_dim, decode, tolerance):
    out, expected = decode(torch.float16, 16, NUM_Q_HEADS // 2, SEQ_LENS[:4], head_dim=head_dim, num_splits=2)
    torch.testing.assert_close(out, expected, **tolerance(torch.float16))


def _new_tokens(seq_lens, num_kv_heads, head_dim, block_size, dtype, block_tables, generator, device, rot_dim=None):
    """Unrotated query, key and value of each sequence's last position, strided views of one fused
    qkv row per sequence as the model produces them; slot -1 for a padded row (seq_len 0)."""
    from gpuworker.models.layers import RotaryEmbedding

    q_size, kv_size = NUM_Q_HEADS * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(len(seq_lens), q_size + 2 * kv_size, generator=generator).to(dtype).to(device)
    query = qkv[:, :q_size].view(-1, NUM_Q_HEADS, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
    rotary = RotaryEmbedding(rot_dim or head_dim, 8192, 500000.0, None).to(device)
    positions = torch.tensor([max(n - 1, 0) for n in seq_lens], device=device)
    tables = block_tables.cpu()
    slots = torch.tensor(
        [
            int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
            for i, n in enumerate(seq_lens)
        ],
        device=device,
    )
    return query, NewTokens(positions, key, value, rotary.cos_cache, rotary.sin_cache, slots)


def _assert_cache_as_unfused(kv_cache, unfused_cache, reference_cache, query, new, dtype, tolerance):
    """The cache after a launch with new_tokens: the values bit for bit, the rotated keys within one
    rounding of the unfused kernel path (rotary kernel writing the cache) and of the torch reference.
    The rotary formula and its roundings are the same, but the compiler may keep one product
    unrounded inside an FMA in one kernel and not the other: on an H200 about 2% of bf16 keys differ
    by one ulp (float32: an ulp of FMA contraction)."""
    apply_rotary_and_cache(
        new.positions,
        query.clone(),
        new.key,
        new.value,
        new.cos_cache,
        new.sin_cache,
        unfused_cache,
        new.slot_mapping,
        qk_norm=new.qk_norm,
    )
    assert torch.equal(kv_cache[1], unfused_cache[1])
    close = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else tolerance(dtype)
    torch.testing.assert_close(kv_cache[0], unfused_cache[0], **close)
    torch.testing.assert_close(kv_cache, reference_cache, **tolerance(dtype))


@pytest.mark.parametrize(("dtype", "gqa"), [(torch.float32, 4), (torch.bfloat16, 1), (torch.bfloat16, 4)], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3, None])
@MERGES
def test_new_tokens_rotated_cached_and_attended_in_the_launch(
    dtype, gqa, num_splits, merge_in_launch, paged_cache, device, generator, tolerance
):
    # The decode step's token arrives unrotated and uncached: the launch rotates q and k, stores k and
    # v in their slot (the cache holds random data there until then) and attends to it. Against
    # the rotary + cache-write reference followed by the attention reference; padded rows included.
    num_kv_heads = NUM_Q_HEADS // gqa
    seq_lens = [0, *SEQ_LENS, 0]
    max_seq_len = 4 * max(seq_lens)  # most partitions empty, as in a graph captured for long contexts
    kv_cache, block_tables = paged_cache(
        seq_lens, num_kv_heads, HEAD_DIM, 16, dtype, generator, table_width=-(-max_seq_len // 16)
    )
    query, new = _new_tokens(seq_lens, num_kv_heads, HEAD_DIM, 16, dtype, block_tables, generator, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    unfused_cache, reference_cache = kv_cache.clone(), kv_cache.clone()
    scale = HEAD_DIM**-0.5
    expected = paged_decode_attention_reference(query, reference_cache, block_tables, lens, scale, new_tokens=new)
    query_before = query.clone()
    out = paged_decode_attention(
        query,
        kv_cache,
        block_tables,
        lens,
        scale,
        max_seq_len,
        num_splits=num_splits,
        merge_in_launch=merge_in_launch,
        new_tokens=new,
        **TILE,
    )
    _assert_cache_as_unfused(kv_cache, unfused_cache, reference_cache, query_before, new, dtype, tolerance)
    assert torch.equal(query, query_before)  # rotated in registers only
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_new_tokens_with_partial_rotary(paged_cache, device, generator, tolerance):
    # Rotary over the first half of each head only (rot_dim < head_dim): the tail passes unrotated.
    seq_lens = SEQ_LENS[:5]
    kv_cache, block_tables = paged_cache(seq_lens, NUM_Q_HEADS // 4, HEAD_DIM, 16, torch.bfloat16, generator)
    query, new = _new_tokens(
        seq_lens, NUM_Q_HEADS // 4, HEAD_DIM, 16, torch.bfloat16, block_tables, generator, device, rot_dim=HEAD_DIM // 2
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    unfused_cache, reference_cache = kv_cache.clone(), kv_cache.clone()
    scale = HEAD_DIM**-0.5
    expected = paged_decode_attention_reference(query, reference_cache, block_tables, lens, scale, new_tokens=new)
    out = paged_decode_attention(
        query, kv_cache, block_tables, lens, scale, max(seq_lens), num_splits=2, new_tokens=new, **TILE
    )
    _assert_cache_as_unfused(kv_cache, unfused_cache, reference_cache, query, new, torch.bfloat16, tolerance)
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))


@pytest.mark.parametrize(("dtype", "gqa"), [(torch.float32, 4), (torch.bfloat16, 2)], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_new_tokens_with_qk_norm(dtype, gqa, num_splits, paged_cache, device, generator, tolerance):
    # Qwen3's decode step: the launch normalises each head of the query and of the new key (q_norm,
    # k_norm) before rotating them; against the rotary kernel with the same norm and the references.
    num_kv_heads = NUM_Q_HEADS // gqa
    seq_lens = [0, *SEQ_LENS]
    kv_cache, block_tables = paged_cache(seq_lens, num_kv_heads, HEAD_DIM, 16, dtype, generator)
    query, new = _new_tokens(seq_lens, num_kv_heads, HEAD_DIM, 16, dtype, block_tables, generator, device)
    query.mul_(3.0)  # rms far from 1 (query, key and value share one qkv), so a missing norm shows
    weights = (1.0 + 0.5 * torch.randn(2, HEAD_DIM, generator=generator)).to(dtype).to(device)
    new = replace(new, qk_norm=QKNorm(weights[0], weights[1], 1e-6))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    unfused_cache, reference_cache = kv_cache.clone(), kv_cache.clone()
    scale = HEAD_DIM**-0.5
    expected = paged_decode_attention_reference(query, reference_cache, block_tables, lens, scale, new_tokens=new)
    without_norm = paged_decode_attention_reference(
        query, kv_cache.clone(), block_tables, lens, scale, new_tokens=replace(new, qk_norm=None)
    )
    query_before = query.clone()
    out = paged_decode_attention(
        query, kv_cache, block_tables, lens, scale, max(seq_lens), num_splits=num_splits, new_tokens=new, **TILE
    )
    _assert_cache_as_unfused(kv_cache, unfused_cache, reference_cache, query_before, new, dtype, tolerance)
    assert torch.equal(query, query_before)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    assert not torch.allclose(expected.float(), without_norm.float(), atol=0.1)


def test_new_tokens_qk_norm_needs_whole_head_rotary(paged_cache, device, generator):
    kv_cache, block_tables = paged_cache([5, 9], 2, HEAD_DIM, 16, torch.float32, generator)
    query, new = _new_tokens(
        [5, 9], 2, HEAD_DIM, 16, torch.float32, block_tables, generator, device, rot_dim=HEAD_DIM // 2
    )
    lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    weight = torch.ones(HEAD_DIM, device=device)
    with pytest.raises(ValueError, match="qk_norm needs rotary over the whole head"):
        paged_decode_attention(
            query, kv_cache, block_tables, lens, 1.0, 9, new_tokens=replace(new, qk_norm=QKNorm(weight, weight, 1e-6))
        )


def test_new_tokens_must_match_the_query(paged_cache, device, generator):
    kv_cache, block_tables = paged_cache([5, 9], 2, HEAD_DIM, 16, torch.float32, generator)
    query, new = _new_tokens([5, 9], 2, HEAD_DIM, 16, torch.float32, block_tables, generator, device)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    short = NewTokens(new.positions[:1], new.key, new.value, new.cos_cache, new.sin_cache, new.slot_mapping)
    with pytest.raises(ValueError, match="positions"):
        paged_decode_attention(query, kv_cache, block_tables, lens, 1.0, 9, new_tokens=short)
    wrong_dtype = NewTokens(
        new.positions, new.key.half(), new.value.half(), new.cos_cache, new.sin_cache, new.slot_mapping
    )
    with pytest.raises(ValueError, match="key"):
        paged_decode_attention(query, kv_cache, block_tables, lens, 1.0, 9, new_tokens=wrong_dtype)


@pytest.mark.parametrize("gqa", [1, 4])
def test_replays_with_the_same_counters_and_leaves_them_zero(gqa, paged_cache, device, generator):
    # As a decode graph runs it: one counter buffer for every launch, which each launch must leave at
    # zero. Padded rows (seq_len 0), contexts within one partition (written directly) and contexts
    # spread over several partitions (merged by the last one) in the same batch.
    num_kv_heads = NUM_Q_HEADS // gqa
    seq_lens = [0, 1, 1000, 17, 0, 4099] if ON_CUDA else [0, 1, 70, 17, 0, 45]
    max_seq_len = 8192 if ON_CUDA else 96
    kv_cache, block_tables = paged_cache(
        seq_lens, num_kv_heads, HEAD_DIM, 16, torch.float32, generator, table_width=max_seq_len // 16
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    counters = SplitCounters().get(len(seq_lens) * num_kv_heads, torch.device(device))
    scale = HEAD_DIM**-0.5
    results = []
    for _ in range(3):
        query = torch.randn(len(seq_lens), NUM_Q_HEADS, HEAD_DIM, generator=generator).to(device)
        out = torch.full_like(query, float("nan"))
        paged_decode_attention(
            query,
            kv_cache,
            block_tables,
            lens,
            scale,
            max_seq_len,
            out=out,
            counters=counters,
            num_splits=MAX_SPLITS if ON_CUDA else 6,
            **TILE,
        )
        assert torch.equal(counters, torch.zeros_like(counters))
        expected = paged_decode_attention_reference(query, kv_cache, block_tables, lens, scale)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[4], torch.zeros_like(out[4]))
        results.append((query, out))
    query, out = results[0]
    again = paged_decode_attention(
        query,
        kv_cache,
        block_tables,
        lens,
        scale,
        max_seq_len,
        counters=counters,
        num_splits=MAX_SPLITS if ON_CUDA else 6,
        **TILE,
    )
    assert torch.equal(again, out)  # a replay gives the same answer, bit for bit


def test_split_counters_grow_and_keep_earlier_buffers():
    counters = SplitCounters(minimum_size=8)
    cpu = torch.device("cpu")
    small = counters.get(3, cpu)
    assert small.numel() == 8 and small.dtype == torch.int32 and not small.any()
    assert counters.get(8, cpu) is small
    large = counters.get(20, cpu)
    assert large.numel() == 20 and large is not small
    assert counters.get(5, cpu) is large
    assert any(buffer is small for buffer in counters._buffers)  # a captured graph may still use it


def test_the_variant_builds_every_constexpr_of_the_kernels():
    # DecodeVariant is the one place where a launch's shapes and switches become constexprs: it
    # names each of the kernel's (USE_PDL aside, which launch.pdl_options sets for every kernel).
    def constexprs(kernel):
        return {
            name
            for name, parameter in inspect.signature(kernel).parameters.items()
            if parameter.annotation in (tl.constexpr, "tl.constexpr")
        } - {"USE_PDL"}

    variant = DecodeVariant(
        block_size=16,
        query_group=6,
        head_dim=80,
        block_n=64,
        num_splits=3,
        dtype=torch.bfloat16,
        merge_in_launch=True,
        new_token=True,
        rotary_half=40,
    )
    built = variant.constexprs()
    assert set(built) == constexprs(_paged_decode_kernel)
    assert (built["GROUP_PAD"], built["BLOCK_D"], built["SPLITS_PAD"], built["SPLIT"]) == (16, 128, 4, True)
    assert set(variant.merge_constexprs()) == constexprs(_merge_partitions_kernel)
    assert not replace(variant, num_splits=1).constexprs()["SPLIT"]


def test_choose_num_splits_fills_the_device_only_when_needed():
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 8, 60, cpu) == 1  # one partition is enough for a short context
    assert choose_num_splits(1, 8, 100_000, cpu) > 1
    assert choose_num_splits(512, 8, 100_000, cpu) == 1  # the batch fills the device by itself
    assert choose_num_splits(1, 1, 10**7, cpu) <= MAX_SPLITS


def test_rejects_bad_arguments(device):
    query = torch.zeros(2, 4, 16, device=device)
    cache = torch.zeros(2, 3, 16, 2, 16, device=device)
    tables = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="must be a multiple of kv heads"):
        paged_decode_attention(torch.zeros(2, 3, 16, device=device), cache, tables, lens, 1.0, 4)
    with pytest.raises(ValueError, match="kv_cache has dtype"):
        paged_decode_attention(query.half(), cache, tables, lens, 1.0, 4)
    with pytest.raises(ValueError, match="block_tables has 1 rows"):
        paged_decode_attention(query, cache, tables[:1], lens, 1.0, 4)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(2,\)"):
        paged_decode_attention(query, cache, tables, lens[:1], 1.0, 4)
    with pytest.raises(ValueError, match="max_seq_len 100 exceeds"):
        paged_decode_attention(query, cache, tables, lens, 1.0, 100)
    with pytest.raises(ValueError, match="max_seq_len must be a non-negative host int"):
        paged_decode_attention(query, cache, tables, lens, 1.0, lens.max())
    with pytest.raises(ValueError, match="num_splits must be in"):
        paged_decode_attention(query, cache, tables, lens, 1.0, 4, num_splits=0)
    with pytest.raises(ValueError, match="out must have shape"):
        paged_decode_attention(query, cache, tables, lens, 1.0, 4, out=torch.zeros(2, 4, 8, device=device))
    with pytest.raises(ValueError, match="counters holds 3 entries but the launch needs"):
        paged_decode_attention(
            query, cache, tables, lens, 1.0, 4, counters=torch.zeros(3, dtype=torch.int32, device=device)
        )
    with pytest.raises(ValueError, match="counters must have dtype"):
        paged_decode_attention(
            query, cache, tables, lens, 1.0, 4, counters=torch.zeros(4, dtype=torch.int64, device=device)
        )


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device")
@MERGES
def test_cuda_graph_replay_follows_device_inputs(merge_in_launch, paged_cache, generator, tolerance):
    # Captured once for max_seq_len 4096; replayed after the sequence lengths, block tables and
    # queries change in place, as the engine's decode graphs are.
    seq_lens = [4096, 1, 2000, 333]
    kv_cache, block_tables = paged_cache(seq_lens, NUM_Q_HEADS // 4, HEAD_DIM, 16, torch.bfloat16, generator)
    query = torch.randn(len(seq_lens), NUM_Q_HEADS, HEAD_DIM, generator=generator).bfloat16().cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    counters = SplitCounters().get(len(seq_lens) * NUM_Q_HEADS // 4, query.device)

    def step():
        paged_decode_attention(
            query,
            kv_cache,
            block_tables,
            lens,
            scale,
            4096,
            out=out,
            counters=counters,
            merge_in_launch=merge_in_launch,
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens in ([17, 4000, 1, 1024], [1, 1, 1, 1], [0, 4096, 0, 2], [4096, 4096, 4096, 4096]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        block_tables.copy_(block_tables[torch.randperm(len(seq_lens), generator=generator).cuda()])
        query.copy_(torch.randn(query.shape, generator=generator).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any()  # every replay leaves the counters at zero for the next
        expected = paged_decode_attention_reference(query, kv_cache, block_tables, lens, scale)
        torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))
