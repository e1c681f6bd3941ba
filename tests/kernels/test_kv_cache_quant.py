"""The FP8 KV cache: its quantization rule, and every kernel that writes or reads the cache with it.

Each kernel on an FP8 cache is checked against its torch reference on the same FP8 cache (the
dtype's usual tolerance: the arithmetic is the same), and against the reference on the float cache
the FP8 one was made from (FP8's tolerance: what quantizing the keys and values costs).
"""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.attention.kv_cache_write import kv_cache_write, kv_cache_write_reference
from gpuworker.kernels.attention.paged_decode import NewTokens, paged_decode_attention, paged_decode_attention_reference
from gpuworker.kernels.attention.prefill import prefill_attention, prefill_attention_reference
from gpuworker.kernels.attention.rotary import apply_rotary, apply_rotary_and_cache, apply_rotary_and_cache_reference
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE, FP8_MAX, dequantize_kv, quantize_kv
from gpuworker.models.layers import RotaryEmbedding

ON_CUDA = torch.cuda.is_available()
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = (32, 8, 128) if ON_CUDA else (4, 2, 32)
# Scales that matter: the random N(0, 1) keys and values span ~±4, i.e. ±80 and ±40 once divided.
K_SCALE, V_SCALE = 0.05, 0.1
SCALES = {"k_scale": K_SCALE, "v_scale": V_SCALE}
SEQ_LENS = [1, 900, 17, 4099] if ON_CUDA else [1, 15, 17, 40]
TILE = {} if ON_CUDA else {"block_n": 16}
# A bfloat16 rotated key near zero is the difference of two products, each rounded to bfloat16: two
# kernels (an FMA kept or not) may disagree there by about an ulp of the products (~±4), in key units.
ROTATED_BF16_KEY_ATOL = 0.05
# What quantizing keys and values to e4m3 (3 mantissa bits: ±3% rounding) costs an attention output
# of N(0, 1) values, against the float cache the FP8 one was made from.
FP8_TOLERANCE = {"atol": 0.1, "rtol": 0.1}


def as_fp8(cache: torch.Tensor) -> torch.Tensor:
    """A float cache [2, ...] quantized as the kernels store it (keys with K_SCALE, values with V_SCALE)."""
    return torch.stack([quantize_kv(cache[0], FP8_DTYPE, K_SCALE), quantize_kv(cache[1], FP8_DTYPE, V_SCALE)])


def assert_same_fp8(got: torch.Tensor, expected: torch.Tensor, atol: float = 2**-9) -> None:
    """The same values (a zero's sign aside) under the interpreter. On a GPU, a rotated key may differ
    from the reference's by an ulp of the activation dtype before it is quantized (an FMA kept or
    not, see test_paged_decode_attention), which can land a few on the neighbouring e4m3 step: at most
    that, or `atol` (in stored units) where the key is a difference of two rounded products."""
    if not ON_CUDA:
        assert torch.equal(got.float(), expected.float())
        return
    assert (got.float() != expected.float()).float().mean() < 0.01
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.13, atol=atol)


def test_quantize_scales_saturates_and_leaves_other_dtypes_alone():
    x = torch.tensor([0.5, -1.0, 96.0, -1e6, 0.0])
    q = quantize_kv(x, FP8_DTYPE, 0.5)
    assert q.dtype == FP8_DTYPE
    assert dequantize_kv(q, 0.5).tolist() == [0.5, -1.0, 96.0, -FP8_MAX * 0.5, 0.0]  # clamped, no NaN
    assert torch.equal(quantize_kv(x, torch.float32, 0.5), x)  # a float cache ignores the scale
    assert torch.equal(dequantize_kv(x.bfloat16(), 0.5), x.bfloat16().float())


def _quotients_a_reciprocal_rounds_elsewhere(scale: float, count: int = 64) -> torch.Tensor:
    """float32 values x whose x / scale and x * (1 / scale) (both rounded to float32) fall on different
    e4m3 steps: CUDA's torch takes the second for a host scalar divisor."""
    scale32 = torch.tensor(scale, dtype=torch.float32)
    # Only quotients within an ulp or two of a midpoint between two e4m3 steps can round apart: take
    # the float32 neighbours of every midpoint times the scale.
    steps = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    steps = steps[torch.isfinite(steps) & (steps > 0)].unique()
    midpoints = (steps[1:] + steps[:-1]) / 2
    near = (midpoints.double() * scale32.double()).float()
    bits = near.view(torch.int32).unsqueeze(1) + torch.arange(-3, 4, dtype=torch.int32)
    x = bits.flatten().view(torch.float32)
    x = torch.cat([x, -x])
    divided = (x.double() / scale32.double()).float()  # correctly rounded float32 quotients
    by_reciprocal = x * (1.0 / scale32)
    differ = divided.to(FP8_DTYPE).float() != by_reciprocal.to(FP8_DTYPE).float()
    found = x[differ][:count]
    assert len(found) > 0
    return found


@pytest.mark.parametrize("scale", [K_SCALE, V_SCALE, 0.3])
def test_quantize_divides_as_the_kernels_do_on_every_device(scale, device):
    # The reference and the cache-write kernel store clamp(x / scale) with an IEEE division, on the
    # GPU too, for exactly the values where a multiply by the reciprocal would land a step away.
    x = _quotients_a_reciprocal_rounds_elsewhere(scale)
    expected = (x.double() / torch.tensor(scale, dtype=torch.float32).double()).float().to(FP8_DTYPE)
    assert torch.equal(quantize_kv(x.to(device), FP8_DTYPE, scale).cpu().float(), expected.float())
    rows = x.view(-1, 1, 1).expand(-1, 1, 16).contiguous().to(device)
    cache = torch.zeros(2, 1, len(x), 1, 16, dtype=FP8_DTYPE, device=device)
    slots = torch.arange(len(x), device=device)
    kv_cache_write(rows, rows, cache, slots, k_scale=scale, v_scale=scale)
    assert torch.equal(cache[0, 0, :, 0, 0].cpu().float(), expected.float())


def test_kernels_refuse_a_scale_that_is_not_positive(device):
    key = torch.zeros(1, 2, 16, device=device)
    cache = torch.zeros(2, 2, 16, 2, 16, dtype=FP8_DTYPE, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
        kv_cache_write(key, key, cache, slots, k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale must be a positive finite number"):
        kv_cache_write(key, key, cache, slots, v_scale=float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_write_quantizes_with_the_scales(dtype, device, generator):
    num_tokens, num_blocks, block_size = 13, 6, 16
    key = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator) * 10).to(dtype).to(device)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
    key[0, 0, 0] = 1e4  # far past FP8_MAX * K_SCALE: saturates
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[3] = -1  # padding
    slots = slots.to(device)
    cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    cache = cache.to(FP8_DTYPE).to(device)
    expected = cache.clone()

    kv_cache_write(key, value, cache, slots, **SCALES)
    kv_cache_write_reference(key, value, expected, slots, **SCALES)

    assert_same_fp8(cache, expected)
    block, offset = int(slots[0]) // block_size, int(slots[0]) % block_size
    assert float(cache[0, block, offset, 0, 0].float()) * K_SCALE == pytest.approx(FP8_MAX * K_SCALE)
    # Against the float values: within e4m3's rounding (3 mantissa bits), below saturation.
    stored = dequantize_kv(
        cache[1, slots[slots >= 0].cpu() // block_size, slots[slots >= 0].cpu() % block_size], V_SCALE
    )
    torch.testing.assert_close(stored, value[(slots >= 0)].float(), rtol=2**-4, atol=V_SCALE * 2**-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_cache_write_quantizes_keys_after_rotating(dtype, device, generator):
    # The fused launch stores what the rotary kernel and then the cache write would (as it does for
    # a float cache), and what the torch reference stores (bfloat16 keys: within the rounding of the
    # rotation's products, which the interpreter may round differently from torch, as test_rotary allows).
    num_tokens, num_blocks, block_size = 9, 4, 16
    qkv = torch.randn(num_tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=generator)
    qkv = qkv.to(dtype).to(device)
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    query = qkv[:, :q_size].view(num_tokens, NUM_Q_HEADS, HEAD_DIM)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, q_size + kv_size :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    rotary = RotaryEmbedding(HEAD_DIM // 2, 4096, 10000.0, None).to(device)  # partial: the tail is copied
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[0] = -1
    slots = slots.to(device)
    cache = torch.zeros(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE, device=device)
    two_step, reference = cache.clone(), cache.clone()

    q2, k2 = apply_rotary(positions, query.clone(), key.clone(), rotary.cos_cache, rotary.sin_cache)
    kv_cache_write(k2, value, two_step, slots, **SCALES)
    apply_rotary_and_cache_reference(
        positions, query, key, value, rotary.cos_cache, rotary.sin_cache, reference, slots, **SCALES
    )
    apply_rotary_and_cache(positions, query, key, value, rotary.cos_cache, rotary.sin_cache, cache, slots, **SCALES)

    assert torch.equal(cache.float(), two_step.float())
    if dtype == torch.float32:
        assert_same_fp8(cache, reference)
    else:  # a rotated key near zero is a difference of two products, each rounded to bfloat16
        torch.testing.assert_close(
            dequantize_kv(cache[0], K_SCALE),
            dequantize_kv(reference[0], K_SCALE),
            rtol=0.13,
            atol=ROTATED_BF16_KEY_ATOL,
        )
        assert torch.equal(cache[1].float(), reference[1].float())


@pytest.fixture
def fp8_and_float_caches(paged_cache, generator):
    """(float cache, the same quantized to FP8, block tables) holding SEQ_LENS tokens."""

    def build(dtype, seq_lens, **kwargs):
        float_cache, block_tables = paged_cache(seq_lens, NUM_KV_HEADS, HEAD_DIM, 16, dtype, generator, **kwargs)
        return float_cache, as_fp8(float_cache), block_tables

    return build


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("v_pairs", [False, True], ids=["v-bytes", "v-pairs"])
def test_paged_decode_on_fp8_cache(dtype, num_splits, v_pairs, fp8_and_float_caches, device, generator, tolerance):
    # v_pairs: V read as 16-bit words and widened in registers (bfloat16 queries; float32 ignores it).
    float_cache, fp8_cache, block_tables = fp8_and_float_caches(dtype, SEQ_LENS)
    query = torch.randn(len(SEQ_LENS), NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5

    out = paged_decode_attention(
        query,
        fp8_cache,
        block_tables,
        lens,
        scale,
        max(SEQ_LENS),
        num_splits=num_splits,
        fp8_v_pairs=v_pairs,
        **TILE,
        **SCALES,
    )

    same_cache = paged_decode_attention_reference(query, fp8_cache, block_tables, lens, scale, **SCALES)
    torch.testing.assert_close(out, same_cache, **tolerance(dtype))
    float_out = paged_decode_attention_reference(query, float_cache, block_tables, lens, scale)
    torch.testing.assert_close(out.float(), float_out.float(), **FP8_TOLERANCE)


def test_paged_decode_on_fp8_cache_takes_a_query_beyond_float16s_range(fp8_and_float_caches, device, generator):
    # The FP8 path's dots take float16 operands: a bfloat16 query past float16's largest value is
    # clamped to it (the scores keep their order), not made inf (inf - inf scores are NaN).
    _, fp8_cache, block_tables = fp8_and_float_caches(torch.bfloat16, SEQ_LENS)
    query = torch.randn(len(SEQ_LENS), NUM_Q_HEADS, HEAD_DIM, generator=generator)
    query[:, :, 0] = 1e5
    query = query.bfloat16().to(device)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5

    out = paged_decode_attention(query, fp8_cache, block_tables, lens, scale, max(SEQ_LENS), **TILE, **SCALES)

    expected = paged_decode_attention_reference(query, fp8_cache, block_tables, lens, scale, **SCALES)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), **FP8_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_quantizes_the_new_token_it_caches_and_attends(
    dtype, num_splits, fp8_and_float_caches, device, generator, tolerance
):
    # The step's own token, rotated and stored by the launch, counts as the cache will hold it: the
    # cache as the fused rotary kernel leaves it, and (float32, where the rotations agree bit for bit)
    # the output and the cache of the torch reference.
    _, fp8_cache, block_tables = fp8_and_float_caches(dtype, SEQ_LENS)
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(len(SEQ_LENS), q_size + 2 * kv_size, generator=generator).to(dtype).to(device)
    query = qkv[:, :q_size].view(-1, NUM_Q_HEADS, HEAD_DIM)
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 500000.0, None).to(device)
    tables = block_tables.cpu()
    slots = torch.tensor(
        [int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(SEQ_LENS)], device=device
    )
    new = NewTokens(
        torch.tensor([n - 1 for n in SEQ_LENS], device=device),
        qkv[:, q_size : q_size + kv_size].view(-1, NUM_KV_HEADS, HEAD_DIM),
        qkv[:, q_size + kv_size :].view(-1, NUM_KV_HEADS, HEAD_DIM),
        rotary.cos_cache,
        rotary.sin_cache,
        slots,
    )
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    unfused_cache, reference_cache = fp8_cache.clone(), fp8_cache.clone()
    scale = HEAD_DIM**-0.5

    expected = paged_decode_attention_reference(
        query, reference_cache, block_tables, lens, scale, new_tokens=new, **SCALES
    )
    out = paged_decode_attention(
        query,
        fp8_cache,
        block_tables,
        lens,
        scale,
        max(SEQ_LENS),
        num_splits=num_splits,
        new_tokens=new,
        **TILE,
        **SCALES,
    )
    apply_rotary_and_cache(
        new.positions, query.clone(), new.key, new.value, new.cos_cache, new.sin_cache, unfused_cache, slots, **SCALES
    )

    # bfloat16 on a GPU: the fused decode kernel and the rotary kernel round the rotation's products
    # each their own way (2 of 10.5 M elements differed on the H200 by 0.03 stored units).
    assert_same_fp8(fp8_cache, unfused_cache, atol=2**-9 if dtype == torch.float32 else ROTATED_BF16_KEY_ATOL / K_SCALE)
    if dtype == torch.float32:
        assert_same_fp8(fp8_cache, reference_cache)
        torch.testing.assert_close(out, expected, **tolerance(dtype))
    else:
        torch.testing.assert_close(out.float(), expected.float(), **FP8_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_on_fp8_cache(dtype, fp8_and_float_caches, device, generator, tolerance):
    # (new tokens, context): fresh prompts and chunks after a cached prefix.
    chunks = [(700, 700), (1, 900), (300, 2348)] if ON_CUDA else [(37, 37), (1, 20), (25, 70)]
    q_lens, seq_lens = [q for q, _ in chunks], [s for _, s in chunks]
    float_cache, fp8_cache, block_tables = fp8_and_float_caches(dtype, seq_lens)
    query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    tiles = {} if ON_CUDA else {"block_m": 16, "block_n": 16}

    out = prefill_attention(query, fp8_cache, starts, lens, block_tables, scale, max(q_lens), **tiles, **SCALES)

    same_cache = prefill_attention_reference(query, fp8_cache, starts, lens, block_tables, scale, **SCALES)
    torch.testing.assert_close(out, same_cache, **tolerance(dtype))
    float_out = prefill_attention_reference(query, float_cache, starts, lens, block_tables, scale)
    torch.testing.assert_close(out.float(), float_out.float(), **FP8_TOLERANCE)


def test_fp8_cache_must_come_with_queries_of_a_float_dtype(fp8_and_float_caches, device):
    _, fp8_cache, block_tables = fp8_and_float_caches(torch.float32, [5])
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="query must have dtype"):
        paged_decode_attention(
            torch.zeros(1, NUM_Q_HEADS, HEAD_DIM, dtype=FP8_DTYPE, device=device), fp8_cache, block_tables, lens, 1.0, 5
        )
