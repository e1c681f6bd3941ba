"""int4_matmul against its torch reference (dequantise, then matmul) for batch 1 to 256, zero points
0..16, bias and ragged tiles; pack_rows / unpack_rows round trips."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.int4_matmul import (dequantize_int4, int4_matmul, int4_matmul_reference, pack_rows,
                                           unpack_rows)

ON_CUDA = torch.cuda.is_available()
# Llama-3-8B's gate_up projection on the GPU; N not a multiple of the tile elsewhere.
N, K, GROUP = (28672, 4096, 128) if ON_CUDA else (40, 96, 32)
ROWS = (1, 16, 17, 64, 256) if ON_CUDA else (1, 17, 40)


def _packed(generator, device, n=N, k=K, group=GROUP):
    q = torch.randint(0, 16, (k, n), generator=generator)
    zeros = torch.randint(0, 17, (k // group, n), generator=generator).to(torch.uint8)
    scales = (0.02 * torch.rand(k // group, n, generator=generator) + 0.001).half()
    return pack_rows(q).to(device), zeros.to(device), scales.to(device), q


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_reference(rows, dtype, device, generator, tolerance):
    qweight, zeros, scales, _ = _packed(generator, device)
    x = torch.randn(rows, K, generator=generator).to(dtype).to(device)
    bias = torch.randn(N, generator=generator).to(dtype).to(device)
    got = int4_matmul(x, qweight, zeros, scales, GROUP, bias)
    assert got.shape == (rows, N) and got.dtype == dtype
    torch.testing.assert_close(got, int4_matmul_reference(x, qweight, zeros, scales, GROUP, bias), **tolerance(dtype))


def test_group_of_a_whole_tile(device, generator, tolerance):
    qweight, zeros, scales, _ = _packed(generator, device, n=24, k=256, group=128)
    x = torch.randn(3, 256, generator=generator).to(device)
    torch.testing.assert_close(int4_matmul(x, qweight, zeros, scales, 128),
                               int4_matmul_reference(x, qweight, zeros, scales, 128), **tolerance(torch.float32))


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
def test_one_row_gemv_over_ragged_columns_packed_rows_and_groups(n, k, group, device, generator, tolerance):
    # One row takes the GEMV, a group per step: columns past a tile, groups of one to sixteen packed rows.
    qweight, zeros, scales, _ = _packed(generator, device, n=n, k=k, group=group)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, k, generator=generator).to(dtype).to(device)
        bias = torch.randn(n, generator=generator).to(dtype).to(device)
        torch.testing.assert_close(int4_matmul(x, qweight, zeros, scales, group, bias),
                                   int4_matmul_reference(x, qweight, zeros, scales, group, bias), **tolerance(dtype))
