"""The kernels' config picks by GPU: on an "NVIDIA H200" exactly what the tables in code chose before they
became gpuworker/kernels/configs/*/NVIDIA_H200.json (those tables are copied below as the expected
data), and on a GPU without files the kernels' own defaults, GEMV leaving every layer to cuBLAS."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels import configs
from gpuworker.kernels.attention.paged_decode import default_tile
from gpuworker.kernels.linear.gemv import CANDIDATES_BY_NAME, pick_config, table_config, tuned_config
from gpuworker.kernels.moe.decode import DEFAULT_CONFIG as MOE_DEFAULT
from gpuworker.kernels.moe.decode import decode_config
from gpuworker.kernels.quant.int4_matmul import (
    DEFAULT_GEMM,
    Int4GemmConfig,
    Int4GemvConfig,
    default_gemv_config,
    pick_gemm_config,
    pick_gemv_config,
)
from gpuworker.kernels.sampling.sample import DEFAULT_CONFIG as SAMPLING_DEFAULT
from gpuworker.kernels.sampling.sample import SamplingConfig, tuned_configs
from gpuworker.kernels.sampling.sample import pick_config as pick_sampling_config

H200 = "NVIDIA H200"
UNKNOWN = "NVIDIA H100 80GB HBM3"

# gemv.TUNED: {(N, K): {M bucket: config}}, the shapes where the kernel beat cuBLAS on the H200.
OLD_GEMV = {
    (6144, 4096): {1: "fma-n16-k512-w4-p1"},
    (4096, 4096): {1: "fma-n16-k512-w4-p3-pf2"},
    (28672, 4096): {1: "fma-n16-k512-w4-p3"},
    (4096, 14336): {1: "fma-n16-k512-w4-p3"},
    (128256, 4096): {1: "dot-n64-k128-w4-p4"},
    (5120, 2048): {1: "fma-n16-k512-w4-p1"},
    (2048, 4096): {1: "fma-n16-k512-w4-p3-pf2"},
    (128, 2048): {1: "fma-n8-k1024-w4-p1"},
    (151936, 2048): {1: "dot-n64-k128-w4-p4"},
}
# gemv.TUNED_FP8.
OLD_GEMV_FP8 = {
    (6144, 4096): {1: "fma-n16-k512-w4-p3-pf2"},
    (4096, 4096): {1: "fma-n8-k1024-w4-p3"},
    (28672, 4096): {1: "fma-n16-k512-w4-p3"},
    (4096, 14336): {1: "fma-n8-k1024-w4-p3"},
}
# int4_matmul.TUNED and TUNED_GEMM.
OLD_INT4_GEMV = {
    (6144, 4096, 128): Int4GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=4, x_words=True),
    (4096, 4096, 128): Int4GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, split_k=1, x_words=True),
    (28672, 4096, 128): Int4GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=1, split_k=2, x_words=True),
    (4096, 14336, 128): Int4GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=1, split_k=8, x_words=True),
}
OLD_INT4_GEMM = {16: Int4GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)}
# sample.TUNED.
OLD_SAMPLING = {
    1: SamplingConfig(block=2048, search_block=1024, prefetch=0, list_capacity=0),
    64: SamplingConfig(max_registers=128),
    512: SamplingConfig(max_registers=128),
}


def old_default_tile(dtype: torch.dtype, head_dim: int, fills_device: bool) -> tuple[int, int, int]:
    """paged_decode.default_tile as it was, the H200's choice in code."""
    if dtype == torch.float32:
        return 16, 4, 2
    if head_dim > 128:
        return 32, 8, 2
    return (128, 4, 3) if fills_device else (64, 8, 2)


@pytest.fixture
def gpu_named(monkeypatch):
    """gpu_named(name): the kernels look their tables up as on a GPU called `name`."""

    def name(device_name: str) -> None:
        monkeypatch.setattr(configs, "device_name", lambda device=None: device_name)

    return name


def _gemv_shapes():
    """Every (M, N, K) of the old tables, at each row bucket, and shapes they did not hold."""
    shapes = {(n, k) for n, k in (*OLD_GEMV, *OLD_GEMV_FP8)} | {(4096, 1024), (1000, 4160)}
    return [(m, n, k) for n, k in sorted(shapes) for m in (1, 2, 3, 4, 8, 16)]


def _old_gemv_table(m, n, k, fp8_weight):
    bucket = 1 << (m - 1).bit_length()
    name = OLD_GEMV_FP8.get((n, k), {}).get(bucket) if fp8_weight else None
    name = name or OLD_GEMV.get((n, k), {}).get(bucket)
    return None if name is None else CANDIDATES_BY_NAME[name]


def test_an_h200_picks_the_gemv_configs_and_the_cublas_shapes_it_picked_before(gpu_named):
    gpu_named(H200)
    for m, n, k in _gemv_shapes():
        for fp8_weight in (False, True):
            old = _old_gemv_table(m, n, k, fp8_weight)
            assert table_config(m, n, k, fp8_weight=fp8_weight) == old, (m, n, k, fp8_weight)
            default = CANDIDATES_BY_NAME["fma-n16-k512-w4-p1" if m == 1 else "dot-n64-k128-w4-p4"]
            assert pick_config(m, n, k, fp8_weight=fp8_weight) == (old or default), (m, n, k, fp8_weight)


def test_an_h200_picks_the_int4_sampling_decode_and_moe_configs_it_picked_before(gpu_named):
    gpu_named(H200)
    for (n, k, group), config in OLD_INT4_GEMV.items():
        assert pick_gemv_config(n, k, group) == config
        assert pick_gemv_config(n, k, 64) == default_gemv_config(n, k, 64)
    for rows in (1, 2, 8, 15, 16, 17, 512):
        for group in (32, 128):
            old = OLD_INT4_GEMM[16]
            expected = Int4GemmConfig(old.block_m, old.block_n, min(old.block_k, group), old.num_warps, old.num_stages)
            assert pick_gemm_config(rows, group, on_cuda=True) == expected
    for rows, bucket in ((1, 1), (2, 64), (63, 64), (64, 64), (65, 512), (512, 512), (4096, 512)):
        assert pick_sampling_config(rows) == OLD_SAMPLING[bucket], rows
    assert tuned_configs() == [OLD_SAMPLING[1], OLD_SAMPLING[64]]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (64, 80, 128, 192, 256):
            for fills_device in (False, True):
                assert default_tile(dtype, head_dim, fills_device) == old_default_tile(dtype, head_dim, fills_device)
    for tokens in (1, 2, 4, 8):  # an empty table: the default tiles for every shape
        assert decode_config(tokens, 8, 2048, 768) == MOE_DEFAULT


def test_an_unknown_gpu_takes_the_defaults_and_cublas(gpu_named):
    gpu_named(UNKNOWN)
    for m, n, k in _gemv_shapes():
        assert table_config(m, n, k) is None  # the layers take F.linear
        assert table_config(m, n, k, fp8_weight=True) is None
        assert pick_config(m, n, k) == CANDIDATES_BY_NAME["fma-n16-k512-w4-p1" if m == 1 else "dot-n64-k128-w4-p4"]
    for n, k, group in OLD_INT4_GEMV:
        assert pick_gemv_config(n, k, group) == default_gemv_config(n, k, group)
    assert pick_gemm_config(8, 128, on_cuda=True) == DEFAULT_GEMM
    assert pick_gemm_config(8, 32, on_cuda=True).block_k == 32
    for rows in (1, 64, 512):
        assert pick_sampling_config(rows) == SAMPLING_DEFAULT
    assert tuned_configs() == [SAMPLING_DEFAULT]
    for fills_device in (False, True):
        assert default_tile(torch.bfloat16, 128, fills_device) == (64, 8, 2)
        assert default_tile(torch.bfloat16, 256, fills_device) == (32, 8, 2)
        assert default_tile(torch.float32, 128, fills_device) == (16, 4, 2)
    assert decode_config(1, 8, 2048, 768) == MOE_DEFAULT


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tuned_config answers for CUDA tensors only")
def test_the_layers_choice_of_gemv_or_cublas_follows_the_gpus_table(gpu_named):
    x = torch.zeros(1, 4096, dtype=torch.bfloat16, device="cuda")
    o_proj = torch.zeros(1, 1, dtype=torch.bfloat16, device="cuda").expand(4096, 4096)
    gpu_named(H200)
    assert tuned_config(x, o_proj) == CANDIDATES_BY_NAME[OLD_GEMV[(4096, 4096)][1]]
    gpu_named(UNKNOWN)
    assert tuned_config(x, o_proj) is None


def test_the_interpreter_takes_the_h200_tables():
    # CPU tensors only reach the kernels under the interpreter, which launches what the H200 does.
    assert configs.device_name(torch.device("cpu")) == configs.INTERPRETER_DEVICE == H200
    assert pick_gemv_config(4096, 4096, 128, torch.device("cpu")) == OLD_INT4_GEMV[(4096, 4096, 128)]
    assert pick_sampling_config(1, torch.device("cpu")) == OLD_SAMPLING[1]
