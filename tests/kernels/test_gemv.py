"""gemv against its torch reference: every candidate config, ragged N and K, bias, fused silu_and_mul input."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels import configs
from gpuworker.kernels.launch import SPLIT_K_COUNTERS
from gpuworker.kernels.linear.activation import silu_and_mul
from gpuworker.kernels.linear.gemv import (
    CANDIDATES,
    CANDIDATES_BY_NAME,
    FP8_CANDIDATES,
    MAX_M,
    TABLE_KEY,
    GemvConfig,
    fuses_rms_norm,
    gemv,
    gemv_argmax,
    gemv_reference,
    gemv_rms_norm,
    gemv_rms_norm_reference,
    pick_config,
    table_config,
    tuned_config,
)
from gpuworker.kernels.norm.rms_norm import rms_norm_reference

ON_CUDA = torch.cuda.is_available()
# N and K that no candidate's BLOCK_N / BLOCK_K divide, so row and K tails are exercised.
N, K = (1000, 4160) if ON_CUDA else (70, 200)
# Long enough that split-K configs give several splits work (and leave one without any).
SPLIT_K_DEPTH = 4160 if ON_CUDA else 1100
FMA = next(c for c in CANDIDATES if not c.use_dot and c.split_k == 1)
DOT = next(c for c in CANDIDATES if c.use_dot and c.split_k == 1)
SPLIT = next(c for c in CANDIDATES if c.split_k > 1)


def make(m, n, k, dtype, generator, device, *, width=None):
    # Unit-variance products: the outputs have magnitude ~sqrt(k), checked with relative tolerances.
    x = torch.randn(m, width or k, generator=generator).to(dtype).to(device)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype).to(device)
    bias = torch.randn(n, generator=generator).to(dtype).to(device)
    return x, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_default_config_matches_reference(dtype, m, with_bias, device, generator, tolerance):
    x, weight, bias = make(m, N, K, dtype, generator, device)
    bias = bias if with_bias else None
    got = gemv(x, weight, bias)
    assert got.shape == (m, N) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, gemv_reference(x, weight, bias), **tolerance(dtype))


@pytest.mark.parametrize("config", CANDIDATES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_candidate(config, dtype, device, generator, tolerance):
    k = SPLIT_K_DEPTH if config.split_k > 1 else K
    for m in (1, 5):
        x, weight, bias = make(m, N, k, dtype, generator, device)
        torch.testing.assert_close(
            gemv(x, weight, bias, config=config), gemv_reference(x, weight, bias), **tolerance(dtype)
        )


@pytest.mark.parametrize("config", [FMA, DOT, SPLIT], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 4])
def test_silu_mul_input_matches_unfused(config, dtype, m, device, generator, tolerance):
    # 3 * randn gate values reach silu's curved part and its negative tail.
    x, weight, bias = make(m, N, K, dtype, generator, device, width=2 * K)
    x = 3 * x
    got = gemv(x, weight, bias, silu_mul_input=True, config=config)
    # Same as the unfused path the engine runs today: the activation kernel, then the projection.
    # The scaled inputs make float32 sums large enough that summation order shows beyond 1e-5
    # (2e-5 seen on an H200 with the tensor-core path), so float32 gets a scale-aware tolerance.
    close = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else tolerance(dtype)
    torch.testing.assert_close(got, gemv_reference(silu_and_mul(x), weight, bias), **close)
    # Triton's interpreter truncates float32 -> bfloat16 casts where the GPU (and torch) round to
    # nearest, so there the rounded activations sit up to one bf16 step below torch's.
    loose = not ON_CUDA and dtype == torch.bfloat16
    torch.testing.assert_close(
        got, gemv_reference(x, weight, bias, silu_mul_input=True), **({"atol": 0.3, "rtol": 0.05} if loose else close)
    )


def test_row_views_and_exact_tiles(device, generator, tolerance):
    # x a row slice of a wider buffer (row stride != K); N and K exact multiples of the blocks.
    n, k = 128, 1024
    wide = torch.randn(3, k + 64, generator=generator).bfloat16().to(device)
    x = wide[:, :k]
    _, weight, _ = make(3, n, k, torch.bfloat16, generator, device)
    for config in (FMA, DOT):
        torch.testing.assert_close(
            gemv(x, weight, config=config), gemv_reference(x, weight), **tolerance(torch.bfloat16)
        )


def test_split_k_leaves_its_tickets_at_zero(device, generator, tolerance):
    config = SPLIT
    x, weight, bias = make(2, N, SPLIT_K_DEPTH, torch.float32, generator, device)
    first = gemv(x, weight, bias, config=config)
    counters = SPLIT_K_COUNTERS[torch.device(device) if not ON_CUDA else x.device]
    assert int(counters.abs().sum()) == 0
    second = gemv(x, weight, bias, config=config)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(first, gemv_reference(x, weight, bias), **tolerance(torch.float32))


def test_pick_config_uses_the_tuned_table(kernel_configs):
    assert not pick_config(1, 4096, 4096).use_dot
    assert pick_config(4, 4096, 4096).use_dot
    tuned = next(c for c in CANDIDATES if c not in (pick_config(1, 1, 1), pick_config(4, 1, 1)))
    kernel_configs("gemv", TABLE_KEY, [dict(weight_dtype="bfloat16", n=4096, k=4096, m=4, config=tuned.name)])
    assert pick_config(3, 4096, 4096) == tuned  # 3 rounds up to the bucket of 4
    assert pick_config(4, 4096, 4096) == tuned
    assert pick_config(8, 4096, 4096) != tuned
    assert pick_config(4, 4096, 14336) != tuned


def test_pick_config_takes_the_fp8_table_for_an_fp8_weight(kernel_configs):
    fp8_choice = FP8_CANDIDATES[0]
    kernel_configs(
        "gemv",
        TABLE_KEY,
        [
            dict(weight_dtype="bfloat16", n=4096, k=4096, m=1, config="fma-n16-k512-w4-p3"),
            dict(weight_dtype="float8_e4m3fn", n=4096, k=4096, m=1, config=fp8_choice.name),
            dict(weight_dtype="bfloat16", n=4096, k=14336, m=1, config="fma-n16-k512-w4-p1"),
        ],
    )
    assert pick_config(1, 4096, 4096, fp8_weight=True) == fp8_choice
    assert pick_config(1, 4096, 4096).name == "fma-n16-k512-w4-p3"
    # No FP8 entry: the bf16 choice.
    kernel_configs("gemv", TABLE_KEY, [], remove=[dict(weight_dtype="float8_e4m3fn", n=4096, k=14336, m=1)])
    assert pick_config(1, 4096, 14336, fp8_weight=True) == pick_config(1, 4096, 14336)
    assert pick_config(1, 4096, 14336).name == "fma-n16-k512-w4-p1"


# Qwen3-30B-A3B's batch-1 projections (N, K) beside its MoE experts.
QWEN3_30B_A3B = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048)}


@pytest.mark.parametrize("name", QWEN3_30B_A3B)
def test_qwen3_moe_projections_take_the_gemv(name, device, generator, tolerance, monkeypatch):
    # On the H200, whose table the model was tuned on: shapes missing from the table go to cuBLAS,
    # and their norm cannot fuse: each has an entry, qkv's fuses the input RMSNorm, lm_head's takes
    # the argmax in its launch (no split-K); the product is F.linear's. The interpreter runs the
    # config over the full K but fewer rows.
    monkeypatch.setattr(configs, "device_name", lambda device=None: "NVIDIA H200")
    n, k = QWEN3_30B_A3B[name]
    config = pick_config(1, n, k)
    assert table_config(1, n, k) == config
    if name == "qkv":
        assert fuses_rms_norm(config)
    if name == "lm_head":
        assert config.split_k == 1
    x, weight, _ = make(1, n if ON_CUDA else min(n, 96), k, torch.bfloat16, generator, device)
    if ON_CUDA:
        assert tuned_config(x, weight) == config
    torch.testing.assert_close(gemv(x, weight, config=config), gemv_reference(x, weight), **tolerance(torch.bfloat16))


def test_empty_batch(device):
    weight = torch.zeros(8, 16, device=device)
    assert gemv(torch.zeros(0, 16, device=device), weight).shape == (0, 8)


def test_bad_input_is_named(device):
    weight = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="at most 16"):
        gemv(torch.zeros(MAX_M + 1, 16, device=device), weight)
    with pytest.raises(ValueError, match="weight must have dtype"):
        gemv(torch.zeros(1, 16, device=device), weight.bfloat16())
    with pytest.raises(ValueError, match="2 \\* weight's K"):
        gemv(torch.zeros(1, 16, device=device), weight, silu_mul_input=True)
    with pytest.raises(ValueError, match="weight's K = 16"):
        gemv(torch.zeros(1, 17, device=device), weight)
    with pytest.raises(ValueError, match="bias must have shape"):
        gemv(torch.zeros(1, 16, device=device), weight, torch.zeros(9, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.zeros(1, 16, device=device), torch.zeros(16, 8, device=device).t())
    with pytest.raises(ValueError, match="block_k must be a positive power of 2"):
        gemv(torch.zeros(1, 16, device=device), weight, config=GemvConfig(16, 96, 4, 2))
    with pytest.raises(ValueError, match="prefetch must be 0 or a power of 2"):
        gemv(torch.zeros(1, 16, device=device), weight, config=GemvConfig(16, 16, 4, 2, prefetch=3))
    with pytest.raises(ValueError, match=">= 16"):
        gemv(torch.zeros(1, 16, device=device), weight, config=GemvConfig(8, 64, 4, 2, use_dot=True))


@pytest.mark.parametrize("config", [c for c in CANDIDATES if fuses_rms_norm(c)], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_input_matches_reference_and_unfused(config, dtype, with_residual, device, generator, tolerance):
    x, weight, bias = make(1, N, K, dtype, generator, device)
    x = 4 * x  # the norm must actually rescale
    residual = torch.randn(1, K, generator=generator).to(dtype).to(device) if with_residual else None
    norm_weight = (1 + torch.rand(K, generator=generator)).to(dtype).to(device)
    x_before = x.clone()

    got, stream = gemv_rms_norm(x, residual, norm_weight, 1e-5, weight, bias, config=config)

    expected, expected_stream = gemv_rms_norm_reference(x, residual, norm_weight, 1e-5, weight, bias)
    torch.testing.assert_close(got, expected, **tolerance(dtype))
    if ON_CUDA or dtype == torch.float32:
        assert torch.equal(stream, expected_stream)  # the residual stream is the rounded sum, exactly
    else:  # the interpreter truncates float32 -> bfloat16 casts where the GPU rounds to nearest
        torch.testing.assert_close(stream, expected_stream, atol=0.0, rtol=2**-7)
    assert torch.equal(x, x_before)
    if residual is None:
        assert stream is x
    # The unfused pair rounds the normalised row to the dtype first: the same within rounding.
    normed = rms_norm_reference(x, norm_weight, 1e-5, residual)
    normed = normed[0] if residual is not None else normed
    torch.testing.assert_close(got, gemv_reference(normed, weight, bias), **tolerance(dtype))


def test_rms_norm_input_refuses_what_it_cannot_fuse(device, generator):
    x, weight, _ = make(2, N, K, torch.float32, generator, device)
    norm_weight = torch.ones(K, device=device)
    with pytest.raises(ValueError, match="one row"):
        gemv_rms_norm(x, None, norm_weight, 1e-5, weight)
    with pytest.raises(ValueError, match="cannot fuse RMSNorm"):
        gemv_rms_norm(x[:1], None, norm_weight, 1e-5, weight, config=DOT)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        gemv_rms_norm(x[:1], None, norm_weight[:-1], 1e-5, weight)


@pytest.mark.parametrize("config", [FMA, DOT], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_argmax_is_that_of_the_output(config, dtype, device, generator, tolerance):
    for m in (1, 5):
        x, weight, bias = make(m, N, K, dtype, generator, device)
        out, ids = gemv_argmax(x, weight, bias, config=config)
        # The same kernel's output, bit for bit, and its argmax (what the sampler took before).
        assert torch.equal(out, gemv(x, weight, bias, config=config))
        assert ids.dtype == torch.int64 and ids.shape == (m,)
        assert torch.equal(ids, out.float().argmax(dim=-1))
        torch.testing.assert_close(out, gemv_reference(x, weight, bias), **tolerance(dtype))


@pytest.mark.parametrize("config", [FMA, DOT], ids=lambda c: c.name)
def test_argmax_ties_nan_and_many_programs(config, device, generator):
    # More programs than one reduction chunk (256), and a row count no block divides.
    n = 300 * config.block_n + 7
    k = 64
    x, weight, _ = make(3, n, k, torch.bfloat16, generator, device)
    x = x.abs()  # with positive inputs, a row of large positive weights wins
    big = torch.full((k,), 4.0, dtype=torch.bfloat16, device=device)
    # Row 0: a maximum repeated in three programs, the first of them in the second reduction chunk.
    first = 260 * config.block_n + 3
    for i in (first, first + config.block_n, n - 1):
        weight[i] = big
    _, ids = gemv_argmax(x, weight, config=config)
    assert ids.tolist() == [first] * 3
    # A NaN beats everything, as in torch.argmax; the first of two, in the last (partial) block.
    weight[n - 2] = float("nan")
    weight[n - 1] = float("nan")
    out, ids = gemv_argmax(x, weight, config=config)
    assert ids.tolist() == [n - 2] * 3 == out.float().argmax(dim=-1).tolist()
    counters = SPLIT_K_COUNTERS[x.device]
    assert int(counters.abs().sum()) == 0  # the ticket is back at zero for the next launch
    # Equal rows everywhere: index 0.
    _, ids = gemv_argmax(x[:1], torch.ones(n, k, dtype=torch.bfloat16, device=device), config=config)
    assert ids.tolist() == [0]


def test_argmax_refuses_what_it_cannot_do(device):
    weight = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="split_k 1"):
        gemv_argmax(torch.zeros(1, 16, device=device), weight, config=SPLIT)
    with pytest.raises(ValueError, match="at most 16"):
        gemv_argmax(torch.zeros(MAX_M + 1, 16, device=device), weight)
    with pytest.raises(ValueError, match="no rows"):
        gemv_argmax(torch.zeros(1, 16, device=device), torch.zeros(0, 16, device=device))
    out, ids = gemv_argmax(torch.zeros(0, 16, device=device), weight)
    assert out.shape == (0, 8) and ids.shape == (0,)


@pytest.mark.parametrize("config", [c for c in CANDIDATES if c.prefetch], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefetched_tiles_give_the_same_product(config, dtype, device, generator, tolerance):
    # K with a tail after the prefetched tiles and the pipelined loop; one row takes the prefetch,
    # several rows (and a K shorter than the prefetch) run without it.
    k = config.prefetch * config.block_k + 3 * config.block_k + 64
    for m, depth in ((1, k), (3, k), (1, config.block_k)):
        x, weight, bias = make(m, N, depth, dtype, generator, device)
        got = gemv(x, weight, bias, config=config)
        torch.testing.assert_close(got, gemv_reference(x, weight, bias), **tolerance(dtype))
        plain = gemv(x, weight, bias, config=CANDIDATES_BY_NAME[config.name.rsplit("-pf", 1)[0]])
        torch.testing.assert_close(got, plain, **tolerance(dtype))


FP8_CONFIGS = [c for c in CANDIDATES if not c.use_dot] + list(FP8_CANDIDATES)


@pytest.mark.parametrize("config", FP8_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_weight_with_row_scales_matches_the_dequantised_product(config, with_bias, device, generator):
    from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE, fp8_matmul_reference

    # Deep enough for split-K configs to give several splits work and for a prefetch to happen.
    k = SPLIT_K_DEPTH if config.split_k > 1 or config.prefetch else K
    x, weight, bias = make(1, N, k, torch.bfloat16, generator, device)
    scale = (weight.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    weight_fp8 = (weight.float() / scale[:, None]).to(FP8_DTYPE)
    bias = bias if with_bias else None
    got = gemv(x, weight_fp8, bias, config=config, weight_scale=scale)
    assert got.shape == (1, N) and got.dtype == torch.bfloat16
    # The same FP8 weight, widened to float32 by torch: only the sums' order and x's dtype differ.
    want = fp8_matmul_reference(x, weight_fp8, scale, bias=bias, out_dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_fp8_weight_is_refused_where_the_kernel_cannot_take_it(device, generator):
    from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE

    x, weight, _ = make(1, N, K, torch.bfloat16, generator, device)
    weight_fp8 = weight.to(FP8_DTYPE)
    scale = torch.ones(N, device=device)
    with pytest.raises(ValueError, match="FMA config"):
        gemv(x, weight_fp8, config=DOT, weight_scale=scale)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv(x, weight_fp8, weight_scale=scale[:-1])
    with pytest.raises(ValueError, match="weight"):
        gemv(x, weight_fp8)  # an FP8 weight without its scales
    assert gemv(x.expand(3, K).contiguous(), weight_fp8, weight_scale=scale).shape == (3, N)  # rows still FMA
