"""The attention kernels at KV-cache offsets past 2^31 elements, where a 1M-token cache lives: a
block id times the block stride, and the value plane's base, must be computed in 64 bits.

The cache is a 4 GiB FP8 tensor left uninitialised, so only the pages of the blocks written here are
ever touched (the interpreter and the references read through block tables); its sequences sit in
the last blocks of each plane, past element 2^31 of the keys and 2^32 of the values."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.attention.kv_cache_write import kv_cache_write
from gpuworker.kernels.attention.paged_decode import paged_decode_attention, paged_decode_attention_reference
from gpuworker.kernels.attention.prefill import prefill_attention, prefill_attention_reference
from tests.kernels.conftest import DEVICE

BLOCK_SIZE, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM = 16, 1, 2, 64
# Blocks of BLOCK_SIZE x NUM_KV_HEADS x HEAD_DIM = 1,024 elements: 2^21 of them fill 2^31 elements.
NUM_BLOCKS = (1 << 21) + 64
FP8_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture(scope="module")
def far_cache():
    """The cache, and a block table per sequence over its last blocks (shuffled, so the table is read)."""
    kv_cache = torch.empty(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn, device=DEVICE)
    assert kv_cache[0, -1].data_ptr() - kv_cache.data_ptr() > 1 << 31
    generator = torch.Generator().manual_seed(0)
    far = NUM_BLOCKS - 1 - torch.randperm(48, generator=generator)
    values = torch.randn(2, len(far), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    kv_cache.view(torch.uint8)[:, far.to(DEVICE)] = values.to(torch.float8_e4m3fn).view(torch.uint8).to(DEVICE)
    tables = far.view(2, 24).to(torch.int32).to(DEVICE)
    return kv_cache, tables, generator


def test_decode_reads_blocks_past_two_to_the_31(far_cache):
    kv_cache, tables, generator = far_cache
    seq_lens = torch.tensor([383, 200], dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, NUM_Q_HEADS, HEAD_DIM, generator=generator).to(DEVICE)
    for num_splits in (1, 4):
        out = paged_decode_attention(
            query, kv_cache, tables, seq_lens, HEAD_DIM**-0.5, 383, num_splits=num_splits, block_n=16
        )
        expected = paged_decode_attention_reference(query, kv_cache, tables, seq_lens, HEAD_DIM**-0.5)
        torch.testing.assert_close(out, expected, **FP8_TOLERANCE)


def test_prefill_reads_blocks_past_two_to_the_31(far_cache):
    kv_cache, tables, generator = far_cache
    # A 40-token chunk at the end of a 300-token context, and a 24-token one of 100.
    query = torch.randn(64, NUM_Q_HEADS, HEAD_DIM, generator=generator).to(DEVICE)
    starts = torch.tensor([0, 40, 64], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([300, 100], dtype=torch.int32, device=DEVICE)
    out = prefill_attention(query, kv_cache, starts, seq_lens, tables, HEAD_DIM**-0.5, 40, block_m=16, block_n=16)
    expected = prefill_attention_reference(query, kv_cache, starts, seq_lens, tables, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, expected, **FP8_TOLERANCE)


def test_cache_write_lands_in_blocks_past_two_to_the_31(far_cache):
    kv_cache, tables, generator = far_cache
    block = int(tables[1, 23])
    slots = torch.tensor([block * BLOCK_SIZE + 3, -1, block * BLOCK_SIZE + 15], dtype=torch.int64, device=DEVICE)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(DEVICE)
    value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(DEVICE)
    before = kv_cache[:, block].view(torch.uint8).clone()
    kv_cache_write(key, value, kv_cache, slots)
    for row, offset in ((0, 3), (2, 15)):
        torch.testing.assert_close(kv_cache[0, block, offset].float(), key[row].to(torch.float8_e4m3fn).float())
        torch.testing.assert_close(kv_cache[1, block, offset].float(), value[row].to(torch.float8_e4m3fn).float())
    untouched = [o for o in range(BLOCK_SIZE) if o not in (3, 15)]
    assert torch.equal(kv_cache[:, block, untouched].view(torch.uint8), before[:, untouched])
