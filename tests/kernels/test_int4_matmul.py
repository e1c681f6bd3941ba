"""int4_matmul against its torch reference (dequantise, then matmul) for batch 1 to 256, zero points
0..16, bias and ragged tiles; the one-row GEMV's configs (multi-group steps, split-K, tails) and the
zero points each loader produces; pack_rows / unpack_rows round trips."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

from gpuworker.kernels.launch import SPLIT_K_COUNTERS
from gpuworker.kernels.quant import int4_matmul as int4_module
from gpuworker.kernels.quant.int4_matmul import (
    GEMM_TABLE_KEY,
    GEMV_TABLE_KEY,
    TARGET_PROGRAMS,
    Int4GemmConfig,
    Int4GemvConfig,
    default_gemv_config,
    dequantize_int4,
    dequantize_int4_to,
    int4_matmul,
    int4_matmul_reference,
    pack_rows,
    pick_gemm_config,
    pick_gemv_config,
    unpack_rows,
)
from tests.kernels.conftest import FLOAT32_LONG_SUMS, TOLERANCES

ON_CUDA = torch.cuda.is_available()
# Llama-3-8B's gate_up projection on the GPU; N not a multiple of the tile elsewhere.
N, K, GROUP = (28672, 4096, 128) if ON_CUDA else (40, 96, 32)
ROWS = (1, 16, 17, 64, 256) if ON_CUDA else (1, 17, 40)


# The zero points each loader leaves (models/quantization): AWQ stores 0..15; GPTQ stores zero - 1, so a
# symmetric checkpoint reads 8 everywhere and an asymmetric one 1..16.
ZERO_POINTS = {"awq": (0, 16), "gptq-sym": (8, 9), "gptq-asym": (1, 17), "any": (0, 17)}


def _packed(generator, device, n=N, k=K, group=GROUP, zero_points="any"):
    q = torch.randint(0, 16, (k, n), generator=generator)
    low, high = ZERO_POINTS[zero_points]
    zeros = torch.randint(low, high, (k // group, n), generator=generator).to(torch.uint8)
    scales = (0.02 * torch.rand(k // group, n, generator=generator) + 0.001).half()
    return pack_rows(q).to(device), zeros.to(device), scales.to(device), q


def assert_matches_reference(got, x, qweight, zeros, scales, group, bias=None):
    """got against the exact product (float64), allowed to stray as far as torch's own path in x's dtype
    (int4_matmul_reference) does, plus that dtype's tolerance.

    torch's path rounds the weight to x's dtype before multiplying; the GEMV and the batched kernel do
    not. At the GPU's shapes (K = 4096 and more) that rounding alone moves outputs near zero by ~5e-3 in
    float16 and ~3e-2 in bfloat16, beyond those dtypes' atol, so a kernel closer to exact than torch
    failed against torch. In float32 the one-row GEMV sums s * (sum q x - z * sum x) per group: another
    order than torch's."""
    tol = FLOAT32_LONG_SUMS if x.dtype == torch.float32 else TOLERANCES[x.dtype]
    exact = int4_matmul_reference(x.double(), qweight, zeros, scales, group, None if bias is None else bias.double())
    torch_error = (int4_matmul_reference(x, qweight, zeros, scales, group, bias).double() - exact).abs().max().item()
    assert got.dtype == x.dtype
    torch.testing.assert_close(got.double(), exact, atol=tol["atol"] + torch_error, rtol=tol["rtol"])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_reference(rows, dtype, device, generator):
    qweight, zeros, scales, _ = _packed(generator, device)
    x = torch.randn(rows, K, generator=generator).to(dtype).to(device)
    bias = torch.randn(N, generator=generator).to(dtype).to(device)
    got = int4_matmul(x, qweight, zeros, scales, GROUP, bias)
    assert got.shape == (rows, N) and got.dtype == dtype
    assert_matches_reference(got, x, qweight, zeros, scales, GROUP, bias)


@pytest.mark.parametrize("group", [8, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dequantize_to_gives_the_references_weight(group, dtype, device, generator):
    qweight, zeros, scales, _ = _packed(generator, device, n=40, k=256, group=group)
    got = dequantize_int4_to(qweight, zeros, scales, group, dtype)
    assert got.shape == (256, 40) and got.dtype == dtype
    expected = dequantize_int4(qweight, zeros, scales, group).t().to(dtype)
    if dtype == torch.bfloat16 and not ON_CUDA:
        # The interpreter rounds float32 -> bfloat16 toward zero (the GPU to nearest): one unit apart.
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("with_bias", [False, True])
def test_many_rows_dequantise_then_multiply(with_bias, monkeypatch, device, generator):
    # From DEQUANT_MIN_ROWS rows the weight is dequantised and multiplied by torch.
    monkeypatch.setattr(int4_module, "DEQUANT_MIN_ROWS", 8)
    qweight, zeros, scales, _ = _packed(generator, device)
    x = torch.randn(12, K, generator=generator).to(torch.bfloat16).to(device)
    bias = torch.randn(N, generator=generator).to(torch.bfloat16).to(device) if with_bias else None
    got = int4_matmul(x, qweight, zeros, scales, GROUP, bias)
    assert_matches_reference(got, x, qweight, zeros, scales, GROUP, bias)


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_batched_kernel(with_bias, device, generator):
    # Rows and columns that leave the last tiles ragged.
    qweight, zeros, scales, _ = _packed(generator, device)
    x = torch.randn(20, K, generator=generator).to(torch.bfloat16).to(device)
    bias = torch.randn(N, generator=generator).to(torch.bfloat16).to(device) if with_bias else None
    config = Int4GemmConfig(64, 128, 64, 4, 3) if ON_CUDA else Int4GemmConfig(16, 32, 32, 4, 1)
    got = int4_matmul(x, qweight, zeros, scales, GROUP, bias, gemm_config=config)
    assert_matches_reference(got, x, qweight, zeros, scales, GROUP, bias)


def test_gemm_tiles_stay_within_a_group(kernel_configs):
    tiles = {
        16: Int4GemmConfig(16, 64, 128, 4, 4),
        64: Int4GemmConfig(64, 128, 64, 4, 4),
        1024: Int4GemmConfig(128, 128, 64, 8, 3),
    }
    kernel_configs("int4_matmul", GEMM_TABLE_KEY, [dict(rows=rows, **asdict(tile)) for rows, tile in tiles.items()])
    assert pick_gemm_config(8, 128, on_cuda=True) == tiles[16]
    assert pick_gemm_config(200, 32, on_cuda=True).block_k == 32
    assert pick_gemm_config(8, 128, on_cuda=True).block_m == 16
    assert pick_gemm_config(10**6, 128, on_cuda=True).block_m == 128


def test_group_of_a_whole_tile(device, generator):
    qweight, zeros, scales, _ = _packed(generator, device, n=24, k=256, group=128)
    x = torch.randn(3, 256, generator=generator).to(device)
    assert_matches_reference(int4_matmul(x, qweight, zeros, scales, 128), x, qweight, zeros, scales, 128)


def test_dequantize_is_q_minus_zero_times_scale(generator):
    qweight, zeros, scales, q = _packed(generator, "cpu", n=16, k=64, group=32)
    weight = dequantize_int4(qweight, zeros, scales, 32)
    assert weight.shape == (16, 64)
    # Input row 37 is in group 1.
    expected = (q[37, 5] - zeros[1, 5].item()) * scales[1, 5].float()
    assert weight[5, 37].item() == pytest.approx(expected.item())


def test_pack_round_trip(generator):
    q = torch.randint(0, 16, (64, 24), generator=generator)
    packed = pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(unpack_rows(packed), q.to(torch.int32))
    # Nibble j of word i is row 8i + j: a word holding 0..15 in its high nibble is negative as int32.
    column = torch.tensor([[j] for j in range(8)]) * 2 + 1  # 1, 3, ..., 15
    assert pack_rows(column).item() == sum(v << (4 * j) for j, v in enumerate(range(1, 16, 2))) - 2**32


def test_bad_input_is_named(device):
    qweight = torch.zeros(4, 8, dtype=torch.int32, device=device)
    zeros = torch.zeros(1, 8, dtype=torch.uint8, device=device)
    scales = torch.ones(1, 8, dtype=torch.float16, device=device)
    x = torch.zeros(2, 32, device=device)
    with pytest.raises(ValueError, match="group_size"):
        int4_matmul(x, qweight, zeros, scales, 24)
    with pytest.raises(ValueError, match="qweight must have K / 8"):
        int4_matmul(torch.zeros(2, 64, device=device), qweight, zeros, scales, 32)
    with pytest.raises(ValueError, match="scales must have dtype"):
        int4_matmul(x, qweight, zeros, scales.float(), 32)
    with pytest.raises(ValueError, match="zeros must have shape"):
        int4_matmul(x, qweight, zeros[:, :4], scales, 32)


def test_no_rows(device, generator):
    qweight, zeros, scales, _ = _packed(generator, device, n=8, k=32, group=32)
    assert int4_matmul(torch.zeros(0, 32, device=device), qweight, zeros, scales, 32).shape == (0, 8)


@pytest.mark.parametrize(("n", "k", "group"), [(37, 104, 8), (70, 160, 16), (32, 512, 128)])
def test_one_row_gemv_over_ragged_columns_packed_rows_and_groups(n, k, group, device, generator):
    # One row takes the GEMV, a group per step: columns past a tile, groups of one to sixteen packed rows.
    qweight, zeros, scales, _ = _packed(generator, device, n=n, k=k, group=group)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, k, generator=generator).to(dtype).to(device)
        bias = torch.randn(n, generator=generator).to(dtype).to(device)
        got = int4_matmul(x, qweight, zeros, scales, group, bias)
        assert_matches_reference(got, x, qweight, zeros, scales, group, bias)


# One-row GEMV tiles: one packed row a step (one group, whatever its size), several groups a step
# (with a last step past the last group where the count does not divide), split-K with and without
# splits left empty, and a split count that is not a power of 2.
GEMV_CONFIGS = [
    Int4GemvConfig(block_n=16, block_k=8, num_warps=4, num_stages=1),
    Int4GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=2),
    Int4GemvConfig(block_n=8, block_k=64, num_warps=2, num_stages=1, split_k=4),
    Int4GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=3, split_k=3),
    Int4GemvConfig(block_n=64, block_k=512, num_warps=4, num_stages=3, split_k=16),
    Int4GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=3, split_k=3, x_words=True),
    Int4GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=2, x_words=True),
]
GEMV_SHAPES = (
    [(37, 104, 8), (70, 160, 16), (40, 352, 32), (32, 512, 128)]
    if not ON_CUDA
    else [(6144, 4096, 128), (4096, 14336, 128), (1000, 4160, 32), (37, 1024, 256)]
)


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize(("n", "k", "group"), GEMV_SHAPES)
def test_one_row_gemv_configs(config, n, k, group, device, generator):
    qweight, zeros, scales, _ = _packed(generator, device, n=n, k=k, group=group)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, k, generator=generator).to(dtype).to(device)
        bias = torch.randn(n, generator=generator).to(dtype).to(device)
        got = int4_matmul(x, qweight, zeros, scales, group, bias, gemv_config=config)
        assert_matches_reference(got, x, qweight, zeros, scales, group, bias)


def test_x_read_as_words_gives_the_same_bits(device, generator):
    # bfloat16 x read as 32-bit words is the same float32 values in the same order: the same output,
    # bit for bit; an x not 4-byte aligned (a view one value in) is read value by value instead.
    n, k, group = (4096, 4096, 128) if ON_CUDA else (72, 256, 32)
    qweight, zeros, scales, _ = _packed(generator, device, n=n, k=k, group=group)
    buffer = torch.randn(1, k + 1, generator=generator).to(torch.bfloat16).to(device)
    config = Int4GemvConfig(block_n=32, block_k=2 * group, num_warps=4, num_stages=2, split_k=2)
    for x in (buffer[:, :k], buffer[:, 1:]):
        by_value = int4_matmul(x, qweight, zeros, scales, group, gemv_config=config)
        by_word = int4_matmul(x, qweight, zeros, scales, group, gemv_config=replace(config, x_words=True))
        assert torch.equal(by_word, by_value)


@pytest.mark.parametrize("zero_points", ["awq", "gptq-sym", "gptq-asym"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_row_gemv_takes_every_loaders_zero_points(zero_points, with_bias, device, generator):
    n, k, group = (4096, 4096, 128) if ON_CUDA else (72, 256, 32)
    qweight, zeros, scales, _ = _packed(generator, device, n=n, k=k, group=group, zero_points=zero_points)
    x = torch.randn(1, k, generator=generator).half().to(device)
    bias = torch.randn(n, generator=generator).half().to(device) if with_bias else None
    got = int4_matmul(x, qweight, zeros, scales, group, bias)
    assert_matches_reference(got, x, qweight, zeros, scales, group, bias)


def test_split_k_gemv_is_deterministic_and_leaves_its_tickets_at_zero(device, generator):
    config = Int4GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=1, split_k=4)
    qweight, zeros, scales, _ = _packed(generator, device, n=40, k=512, group=32)
    x = torch.randn(1, 512, generator=generator).to(device)
    first = int4_matmul(x, qweight, zeros, scales, 32, gemv_config=config)
    assert int(SPLIT_K_COUNTERS[x.device].abs().sum()) == 0
    second = int4_matmul(x, qweight, zeros, scales, 32, gemv_config=config)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert_matches_reference(first, x, qweight, zeros, scales, 32)


def test_default_gemv_config_splits_k_until_the_gpu_is_full():
    # Llama-3-8B's projections: 64 columns a program, split-K up to ~TARGET_PROGRAMS programs.
    assert default_gemv_config(4096, 4096, 128).split_k == 8  # o_proj: 64 column blocks
    assert default_gemv_config(6144, 4096, 128).split_k == 8  # qkv: 96
    assert default_gemv_config(28672, 4096, 128).split_k == 2  # gate_up: 448
    assert default_gemv_config(4096, 14336, 128).split_k == 8  # down
    # Never more splits than steps: K = 512 in 256-row steps is two.
    assert default_gemv_config(64, 512, 128).split_k == 2
    # A group wider than a step is a step of one group.
    assert default_gemv_config(64, 1024, 512).split_k == 2
    assert TARGET_PROGRAMS >= 4 * 64


def test_pick_gemv_config_uses_the_tuned_table(kernel_configs):
    tuned = Int4GemvConfig(block_n=128, block_k=512, num_warps=8, num_stages=2, split_k=5)
    kernel_configs("int4_gemv", GEMV_TABLE_KEY, [dict(n=4096, k=4096, group_size=128, **asdict(tuned))])
    assert pick_gemv_config(4096, 4096, 128) == tuned
    assert pick_gemv_config(4096, 4096, 64) == default_gemv_config(4096, 4096, 64)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (Int4GemvConfig(block_n=24, block_k=64, num_warps=4, num_stages=1), "block_n must be a power of 2"),
        (Int4GemvConfig(block_n=16, block_k=4, num_warps=4, num_stages=1), "block_k must be at least 8"),
        (Int4GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=0), "num_stages must be a positive int"),
        (Int4GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=1, split_k=0), "split_k must be a positive"),
    ],
)
def test_bad_gemv_config_is_named(config, message, device):
    qweight, zeros, scales = (
        torch.zeros(4, 8, dtype=torch.int32, device=device),
        torch.zeros(1, 8, dtype=torch.uint8, device=device),
        torch.ones(1, 8, dtype=torch.float16, device=device),
    )
    with pytest.raises(ValueError, match=message):
        int4_matmul(torch.zeros(1, 32, device=device), qweight, zeros, scales, 32, gemv_config=config)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device")
def test_split_k_gemv_replays_in_a_cuda_graph(generator):
    # As the engine runs it: a warm-up outside capture (which creates the tickets), then replays of
    # the captured launch on new inputs, each matching the reference.
    config = Int4GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, split_k=8)
    qweight, zeros, scales, _ = _packed(generator, "cuda", n=4096, k=4096, group=128)
    x = torch.randn(1, 4096, generator=generator).bfloat16().cuda()
    int4_matmul(x, qweight, zeros, scales, 128, gemv_config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_matmul(x, qweight, zeros, scales, 128, gemv_config=config)
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, generator=generator).bfloat16())
        graph.replay()
        assert_matches_reference(out, x, qweight, zeros, scales, 128)
