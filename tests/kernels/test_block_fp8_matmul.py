"""block_fp8_matmul and quantize_fp8_groups against their torch references: M from one decode row to
a prefill batch, N and K that are not multiples of the 128-column groups, per-block and per-row
weight scales, bias, every output dtype; the quantizer's bytes equal the reference's."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.quant import block_fp8_matmul as block_module
from gpuworker.kernels.quant.block_fp8_matmul import (
    DEFAULT_CONFIGS,
    BlockFp8GemmConfig,
    block_fp8_matmul,
    block_fp8_matmul_reference,
    dequantize_block_fp8,
    pick_config,
    quantize_fp8_groups,
    quantize_fp8_groups_reference,
)
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE, FP8_MAX

ON_CUDA = torch.cuda.is_available()
# (M, N, K): DeepSeek-V3's shapes on the GPU; on the interpreter small ones, with N and K ragged
# against 128 (a partial last block of rows and of columns) and exact.
SHAPES = (
    [(1, 7168, 2048), (16, 4096, 7168), (17, 7168, 18432), (256, 24576, 1536)]
    if ON_CUDA
    else [(1, 72, 200), (5, 128, 256), (17, 200, 300), (40, 96, 128)]
)
BLOCK = (128, 128)


def _weight(n: int, k: int, block: tuple[int, int], generator, device):
    """A random FP8 weight [n, k] and block scales [ceil(n / rows), ceil(k / columns)], the scales
    spread over two orders of magnitude so that a scale read from the wrong block shows."""
    rows, cols = block
    q = (torch.randn(n, k, generator=generator) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = torch.exp(torch.randn(-(-n // rows), -(-k // cols), generator=generator) * 2) * 1e-3
    return q.to(device), scale.to(device)


def _tolerance(dtype, k):
    # float32 sums of K products, in another order; FP8 tensor-core sums of each 128-product block
    # on the GPU (fewer bits than float32 before the block's scale).
    if dtype == torch.float32:
        return {"atol": 2e-3, "rtol": 2e-3} if ON_CUDA else {"atol": 1e-4, "rtol": 1e-5}
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matmul_equals_the_float32_reference(shape, dtype, device, generator):
    m, n, k = shape
    weight, scale = _weight(n, k, BLOCK, generator, device)
    x = torch.randn(m, k, generator=generator).to(dtype).to(device)
    x_q, x_scale = quantize_fp8_groups(x, BLOCK[1], use_kernel=True)
    bias = torch.randn(n, generator=generator).to(dtype).to(device)
    got = block_fp8_matmul(x_q, x_scale, weight, scale, *BLOCK, bias=bias, out_dtype=dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    # The reference written out: both operands dequantised to float32 block by block.
    x_f = x_q.float().cpu() * x_scale.cpu().repeat_interleave(BLOCK[1], dim=1)[:, :k]
    w_f = weight.float().cpu() * scale.cpu().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    expected = (x_f @ w_f.t() + bias.float().cpu()).to(dtype)
    torch.testing.assert_close(got.cpu(), expected, **_tolerance(dtype, k))
    reference = block_fp8_matmul_reference(x_q, x_scale, weight, scale, *BLOCK, bias=bias, out_dtype=dtype)
    torch.testing.assert_close(got, reference, **_tolerance(dtype, k))


@pytest.mark.parametrize("block", [(128, 128), (1, 128), (64, 32), (96, 64)], ids=str)
def test_other_block_shapes_and_per_row_scales(block, device, generator):
    # group_n 1 is what a fused projection whose shards end inside a block keeps; rows per block need
    # not be a power of two (96).
    m, n, k = (33, 160, 200) if not ON_CUDA else (33, 4096, 7168)
    weight, scale = _weight(n, k, block, generator, device)
    x = torch.randn(m, k, generator=generator).to(device)
    x_q, x_scale = quantize_fp8_groups(x, block[1], use_kernel=True)
    got = block_fp8_matmul(x_q, x_scale, weight, scale, *block, out_dtype=torch.float32)
    expected = block_fp8_matmul_reference(x_q, x_scale, weight, scale, *block, out_dtype=torch.float32)
    torch.testing.assert_close(got, expected, **_tolerance(torch.float32, k))


def test_every_default_tile_gives_the_same_answer(device, generator):
    m, n, k = 20, 150, 260
    weight, scale = _weight(n, k, BLOCK, generator, device)
    x_q, x_scale = quantize_fp8_groups(torch.randn(m, k, generator=generator).to(device), 128, use_kernel=True)
    expected = block_fp8_matmul_reference(x_q, x_scale, weight, scale, *BLOCK, out_dtype=torch.float32)
    for config in (*DEFAULT_CONFIGS.values(), BlockFp8GemmConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)):
        got = block_fp8_matmul(x_q, x_scale, weight, scale, *BLOCK, out_dtype=torch.float32, config=config)
        torch.testing.assert_close(got, expected, **_tolerance(torch.float32, k), msg=config.name)


@pytest.mark.parametrize("split_k", [2, 3, 5, 0], ids=lambda s: f"split{s or '-auto'}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_k_adds_the_partial_sums_and_the_bias_once(split_k, dtype, device, generator):
    # Decode-shaped: few rows, K split over programs (5 column groups, the last partial; a split of 5
    # leaves each program one group; more splits than groups would leave programs without any).
    m, n, k = 3, 100, 600
    weight, scale = _weight(n, k, BLOCK, generator, device)
    x_q, x_scale = quantize_fp8_groups(
        torch.randn(m, k, generator=generator).to(dtype).to(device), 128, use_kernel=True
    )
    bias = torch.randn(n, generator=generator).to(dtype).to(device)
    config = BlockFp8GemmConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, split_k=split_k)
    got = block_fp8_matmul(x_q, x_scale, weight, scale, *BLOCK, bias=bias, out_dtype=dtype, config=config)
    expected = block_fp8_matmul_reference(x_q, x_scale, weight, scale, *BLOCK, bias=bias, out_dtype=dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **_tolerance(dtype, k))


def test_auto_split_fills_the_device_with_programs(monkeypatch):
    from gpuworker.kernels.attention import paged_decode

    monkeypatch.setattr(paged_decode, "multiprocessor_count", lambda device: 132)
    split = block_module.auto_split_k
    cuda = torch.device("cuda", 0)
    # DeepSeek-V3's q_a_proj at decode: 24 tiles of 64 columns, 56 column groups -> 11 splits.
    assert split(24, 56, cuda) == 11
    assert split(600, 56, cuda) == 1  # the tiles fill the device already
    assert split(1, 4, cuda) == 2  # at least two column groups a program
    assert split(1, 1000, cuda) == block_module.MAX_SPLIT_K


def test_default_tiles_without_a_table():
    # A GPU with no configs/block_fp8_matmul file takes the defaults by row bucket.
    assert pick_config(1, on_cuda=False) == block_module.INTERPRETER_CONFIG
    assert DEFAULT_CONFIGS[16].block_m == 16  # decode batches: the smallest tensor-core tile
    assert sorted(DEFAULT_CONFIGS)[-1] >= 1 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [128, 300, 1000, 2176], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("group", [128, 32], ids=lambda g: f"g{g}")
def test_quantize_groups_kernel_gives_the_references_bytes(dtype, k, group, device, generator):
    # Rows and groups of very different magnitudes, one all-zero row and one all-zero group.
    x = torch.randn(5, k, generator=generator) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 500.0])[:, None]
    x[1, :group] = 0.0
    x[2, -1] = 7000.0  # the last, perhaps partial, group has its own scale
    x = x.to(dtype).to(device)
    q, scale = quantize_fp8_groups(x, group, use_kernel=True)
    q_ref, scale_ref = quantize_fp8_groups_reference(x, group)
    assert q.shape == x.shape and q.dtype == FP8_DTYPE and scale.shape == (5, -(-k // group))
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())  # the same values (a zero may lose its sign)
    # Each group's largest magnitude maps to FP8_MAX and the values come back within e4m3's rounding.
    groups = torch.nn.functional.pad(q.float().abs(), (0, -k % group)).reshape(5, -1, group).amax(dim=-1)
    assert torch.equal(groups[scale > 1e-11], torch.full_like(groups[scale > 1e-11], FP8_MAX))
    # (half a step of e4m3: 1/16 of a normal value, 2^-10 of the scale among the subnormals).
    back, x32 = dequantize_block_fp8(q, scale, 1, group), x.float()
    step = x32.abs() / 16 + scale.repeat_interleave(group, dim=1)[:, :k] * 2**-10
    assert ((back - x32).abs() <= step * (1 + 1e-6)).all()


def test_quantize_groups_takes_strided_rows(device, generator):
    x = torch.randn(4, 384, generator=generator).to(device)[:, :300]
    q, scale = quantize_fp8_groups(x, 128, use_kernel=True)
    q_ref, scale_ref = quantize_fp8_groups_reference(x, 128)
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(scale, scale_ref)


def test_bad_input_is_named(device):
    weight = torch.zeros(8, 256, device=device).to(FP8_DTYPE)
    scale = torch.ones(1, 2, device=device)
    x_q = torch.zeros(2, 256, device=device).to(FP8_DTYPE)
    x_scale = torch.ones(2, 2, device=device)
    with pytest.raises(ValueError, match="weight has 256 columns but x_q has 128"):
        block_fp8_matmul(x_q[:, :128], x_scale[:, :1], weight, scale, 128, 128)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        block_fp8_matmul(x_q, x_scale, weight, torch.ones(2, 2, device=device), 128, 128)
    with pytest.raises(ValueError, match="x_scale must have shape"):
        block_fp8_matmul(x_q, torch.ones(2, 1, device=device), weight, scale, 128, 128)
    with pytest.raises(ValueError, match="group_k must be a power of two"):
        block_fp8_matmul(x_q, x_scale, weight, scale, 128, 100)
    with pytest.raises(ValueError, match="x_q must have dtype"):
        block_fp8_matmul(x_q.float(), x_scale, weight, scale, 128, 128)
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        quantize_fp8_groups(torch.zeros(2, 256, device=device), 96)


def test_a_gpu_without_fp8_is_named(monkeypatch):
    # An A100 (8.0) has no e4m3 tensor cores: refused at load, with the GPU named, not at its first step.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or later .* A100-SXM4-80GB is 8\.0"):
        block_module.check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    block_module.check_fp8_device(torch.device("cuda", 0))
    block_module.check_fp8_device(torch.device("cpu"))


def test_no_rows(device):
    weight = torch.zeros(8, 256, device=device).to(FP8_DTYPE)
    x_q = torch.zeros(0, 256, device=device).to(FP8_DTYPE)
    out = block_fp8_matmul(x_q, torch.ones(0, 2, device=device), weight, torch.ones(1, 2, device=device), 128, 128)
    assert out.shape == (0, 8)


def test_one_specialisation_whatever_the_rows(device, generator, monkeypatch):
    # Row counts of a serving run, split and unsplit: one compiled variant per split, not one per
    # pattern of M or of the partial sums' stride (M * N) being divisible by 16.
    from tests.kernels.test_specialization import _record_patterns

    patterns = _record_patterns(monkeypatch, with_constexprs=True)
    weight, scale = _weight(100, 512, BLOCK, generator, device)  # M * 100: a multiple of 16 or not
    for m in (1, 3, 16, 17, 32, 48):
        x_q, x_scale = quantize_fp8_groups(torch.randn(m, 512, generator=generator).to(device), 128, use_kernel=True)
        for split_k in (1, 2):
            config = BlockFp8GemmConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, split_k=split_k)
            block_fp8_matmul(x_q, x_scale, weight, scale, *BLOCK, out_dtype=torch.float32, config=config)
    assert len(patterns["_block_fp8_matmul_kernel"]) == 2
    assert len(patterns["_quantize_groups_kernel"]) == 1
