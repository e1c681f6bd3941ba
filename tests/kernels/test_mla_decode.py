"""The Triton MLA decode kernel and the latent cache write against their torch references, over
block sizes, ragged context lengths (empty included), head counts below and above a head tile, split
counts, and float32 / bfloat16; on Triton's CPU interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.attention.mla_cache_write import mla_cache_write, mla_cache_write_reference
from gpuworker.kernels.attention.mla_decode import MLADecodeConfig, mla_decode, mla_decode_reference
from tests.kernels.conftest import DEVICE, TOLERANCES

KV_RANK, ROPE = (512, 64) if DEVICE == "cuda" else (32, 16)


def _latent_cache(seq_lens, block_size, num_heads, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    width = KV_RANK + ROPE
    tables_len = max(-(-n // block_size) for n in seq_lens) or 1
    num_blocks = len(seq_lens) * tables_len + 1
    cache = torch.randn(num_blocks, block_size, width, generator=generator).to(dtype)
    # Each sequence's blocks in a shuffled order, so a table is never the identity.
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    tables = order[: len(seq_lens) * tables_len].view(len(seq_lens), tables_len).to(torch.int32)
    query = torch.randn(len(seq_lens), num_heads, width, generator=generator).to(dtype)
    return query.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_size, seq_lens, num_heads, splits",
    [
        (16, [1, 17, 40], 4, 1),
        (16, [33, 0, 5], 16, 2),
        (8, [70, 3], 20, 4),
        (32, [100], 4, 3),
    ],
)
def test_mla_decode_matches_reference(dtype, block_size, seq_lens, num_heads, splits):
    query, cache, tables = _latent_cache(seq_lens, block_size, num_heads, dtype, seed=len(seq_lens) + num_heads)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = 0.1
    out = mla_decode(
        query,
        cache,
        tables,
        seq_lens_t,
        scale,
        KV_RANK,
        max(seq_lens),
        config=MLADecodeConfig(block_n=16),
        num_splits=splits,
    )
    expected = mla_decode_reference(query, cache, tables, seq_lens, scale, KV_RANK)
    assert out.shape == (len(seq_lens), num_heads, KV_RANK) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert not out[b].any()


def test_mla_decode_default_splits_follow_max_seq_len():
    query, cache, tables = _latent_cache([90, 12], 16, 4, torch.float32, seed=3)
    seq_lens = torch.tensor([90, 12], dtype=torch.int32, device=DEVICE)
    config = MLADecodeConfig(block_n=16, split_tokens=32)
    out = mla_decode(query, cache, tables, seq_lens, 0.2, KV_RANK, 90, config=config)
    torch.testing.assert_close(
        out, mla_decode_reference(query, cache, tables, [90, 12], 0.2, KV_RANK), **TOLERANCES[torch.float32]
    )


def test_mla_decode_rejects_a_query_of_another_width():
    query, cache, tables = _latent_cache([4], 16, 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="query width"):
        mla_decode(query[..., :-1], cache, tables, torch.tensor([4], dtype=torch.int32, device=DEVICE), 0.1, KV_RANK, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_cache_write_matches_reference_and_skips_padding(dtype):
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(5, KV_RANK, generator=generator).to(dtype).to(DEVICE)
    k_pe = torch.randn(5, ROPE, generator=generator).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 0, -1], dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(2, 16, KV_RANK + ROPE, dtype=dtype, device=DEVICE)
    expected = cache.clone()
    mla_cache_write(latent, k_pe, cache, slots)
    mla_cache_write_reference(latent, k_pe, expected, slots)
    assert torch.equal(cache, expected)
    assert torch.equal(cache.view(-1, KV_RANK + ROPE)[17], torch.cat((latent[2], k_pe[2])))
    assert cache.view(-1, KV_RANK + ROPE).count_nonzero(dim=1).gt(0).sum() == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU compiles these itself")
@pytest.mark.parametrize("dtype, fp8", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_mla_kernels_compile_for_sm90_at_deepseek_shapes(dtype, fp8, monkeypatch):
    """kv_lora_rank 512 and rope 64 (DeepSeek-V2/V3), the default tile, the model's dtype or an FP8
    cache: compiled offline for an H100/H200."""
    from gpuworker.kernels.quant.kv_cache import FP8_DTYPE
    from tests.kernels.sm90_compile import compile_sm90, record_launches

    launches = record_launches(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 16, 576, generator=generator).to(FP8_DTYPE if fp8 else dtype)
    query = torch.randn(2, 16, 576, generator=generator).to(dtype)
    tables = torch.tensor([[1, 2], [2, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32)
    mla_decode(query, cache, tables, seq_lens, 0.1, 512, 4096)
    mla_cache_write(query[:, 0, :512], query[:, 0, 512:], cache, torch.tensor([3, -1]))
    for name in ("_mla_decode_partition_kernel", "_mla_decode_merge_kernel", "_mla_cache_write_kernel"):
        (launch,) = launches[name]
        compile_sm90(launch)


def test_mla_decode_rejects_a_cache_whose_blocks_are_not_contiguous():
    query, cache, tables = _latent_cache([4], 16, 4, torch.float32, seed=2)
    with pytest.raises(ValueError, match="contiguous blocks"):
        mla_decode(query, cache[:, ::2], tables, torch.tensor([4], dtype=torch.int32, device=DEVICE), 0.1, KV_RANK, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_scale", [1.0, 0.05])
def test_mla_decode_reads_an_fp8_cache(dtype, kv_scale):
    from gpuworker.kernels.quant.kv_cache import FP8_DTYPE, quantize_kv

    seq_lens = [23, 0, 64]
    query, cache, tables = _latent_cache(seq_lens, 16, 4, dtype, seed=4)
    fp8_cache = quantize_kv(cache.float(), FP8_DTYPE, kv_scale)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = mla_decode(query, fp8_cache, tables, seq_lens_t, 0.1, KV_RANK, 64, num_splits=2, kv_scale=kv_scale)
    expected = mla_decode_reference(query, fp8_cache, tables, seq_lens, 0.1, KV_RANK, kv_scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_cache_write_quantizes_for_an_fp8_cache_as_the_reference(dtype):
    from gpuworker.kernels.quant.kv_cache import FP8_DTYPE

    generator = torch.Generator().manual_seed(1)
    latent = (4 * torch.randn(6, KV_RANK, generator=generator)).to(dtype).to(DEVICE)
    k_pe = (4 * torch.randn(6, ROPE, generator=generator)).to(dtype).to(DEVICE)
    slots = torch.tensor([5, -1, 9, 30, 1, -1], dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(2, 16, KV_RANK + ROPE, device=DEVICE).to(FP8_DTYPE)
    expected = cache.clone()
    mla_cache_write(latent, k_pe, cache, slots, kv_scale=0.02)
    mla_cache_write_reference(latent, k_pe, expected, slots, kv_scale=0.02)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
