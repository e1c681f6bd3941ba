"""The sweeps' --write-configs on the CPU: what each script records from its (here made-up) timings is
what the kernel then picks on that GPU, read back through gpuworker.kernels.configs from a temporary
folder. The timed sweeps themselves run only on a GPU."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels import configs

GPU = "Test GPU 80GB"


@pytest.fixture
def on_test_gpu(tmp_path, monkeypatch):
    """write(kernel, key, records, remove=()): merged into an empty configs folder the kernels read, as
    the tables of the GPU they run on (GPU)."""
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(configs, "device_name", lambda device=None: GPU)

    def write(kernel, key, records, remove=()):
        return configs.write(kernel, key, records, device=GPU, remove=remove)

    return write


def test_gemv_records_one_row_winners_and_leaves_cublas_shapes_to_cublas(bench_script, on_test_gpu):
    from gpuworker.kernels.linear.gemv import CANDIDATES_BY_NAME, TABLE_KEY, pick_config, table_config

    gemv = bench_script("gemv")
    results = [
        {
            "shape": "qkv",
            "N": 6144,
            "K": 4096,
            "M": 1,
            "cublas_us": 10.0,
            "best_config": "fma-n16-k512-w4-p3",
            "speedup": 1.2,
        },
        {
            "shape": "o_proj",
            "N": 4096,
            "K": 4096,
            "M": 1,
            "cublas_us": 5.0,
            "best_config": "fma-n16-k512-w4-p1",
            "speedup": 0.9,
        },
        {
            "shape": "qkv",
            "N": 6144,
            "K": 4096,
            "M": 4,
            "cublas_us": 12.0,
            "best_config": "dot-n64-k128-w4-p4",
            "speedup": 1.1,
        },
    ]
    # An earlier sweep's record for o_proj, where cuBLAS now wins.
    on_test_gpu("gemv", TABLE_KEY, [dict(weight_dtype="bfloat16", n=4096, k=4096, m=1, config="fma-n16-k512-w4-p3")])
    on_test_gpu("gemv", TABLE_KEY, *gemv.config_records(results, "llama-3-8b"))
    assert table_config(1, 6144, 4096) == CANDIDATES_BY_NAME["fma-n16-k512-w4-p3"]
    assert table_config(1, 4096, 4096) is None  # cuBLAS
    assert table_config(4, 6144, 4096) is None  # only one-row winners are written
    assert pick_config(4, 6144, 4096) == CANDIDATES_BY_NAME["dot-n64-k128-w4-p4"]  # the default


def test_quant_gemv_records_int4_and_fp8_winners(bench_script, on_test_gpu):
    from gpuworker.kernels.linear.gemv import CANDIDATES_BY_NAME, TABLE_KEY, pick_config
    from gpuworker.kernels.quant.int4_matmul import GEMV_TABLE_KEY, Int4GemvConfig, pick_gemv_config

    quant_gemv = bench_script("quant_gemv")
    int4 = Int4GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=1, split_k=2, x_words=True)
    rows = [
        {
            "kernel": "int4",
            "shape": "gate_up",
            "N": 28672,
            "K": 4096,
            "group": 128,
            "best": int4,
            "best_config": int4.name,
        },
        {
            "kernel": "fp8",
            "shape": "o_proj",
            "N": 4096,
            "K": 4096,
            "group": None,
            "best": CANDIDATES_BY_NAME["fma-n8-k1024-w4-p3"],
            "best_config": "fma-n8-k1024-w4-p3",
        },
        {"kernel": "fp8", "shape": "down", "N": 4096, "K": 14336, "group": None},
    ]  # nothing passed
    records = quant_gemv.config_records(rows)
    on_test_gpu("int4_gemv", GEMV_TABLE_KEY, records["int4_gemv"])
    on_test_gpu("gemv", TABLE_KEY, records["gemv"])
    assert pick_gemv_config(28672, 4096, 128) == int4
    assert pick_config(1, 4096, 4096, fp8_weight=True).name == "fma-n8-k1024-w4-p3"
    assert pick_config(1, 4096, 4096).name == "fma-n16-k512-w4-p1"  # a bf16 weight: no record, the default


def test_quant_gemm_records_the_buckets_below_the_crossover(bench_script, on_test_gpu):
    from gpuworker.kernels.quant.int4_matmul import GEMM_TABLE_KEY, Int4GemmConfig, pick_gemm_config

    quant_gemm = bench_script("quant_gemm")
    tiles = {tile.name: tile for tile in (Int4GemmConfig(16, 64, 128, 4, 4), Int4GemmConfig(64, 128, 64, 4, 4))}
    small, large = tiles
    on_test_gpu(
        "int4_matmul", GEMM_TABLE_KEY, [dict(rows=512, block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)]
    )
    # Dequantise-then-mm wins from 16 rows: the 16-row bucket is kept (it serves 2 to 15 rows), 512's goes.
    on_test_gpu(
        "int4_matmul", GEMM_TABLE_KEY, *quant_gemm.config_records({16: small, 64: large, 512: large}, 16, tiles)
    )
    assert pick_gemm_config(8, 128, on_cuda=True) == tiles[small]
    assert pick_gemm_config(1000, 128, on_cuda=True) == tiles[small]
    # Without a crossover every bucket is kept.
    on_test_gpu("int4_matmul", GEMM_TABLE_KEY, *quant_gemm.config_records({16: small, 64: large}, None, tiles))
    assert pick_gemm_config(40, 128, on_cuda=True) == tiles[large]


def test_block_fp8_gemm_records_each_row_buckets_fastest_tile(bench_script, on_test_gpu):
    from gpuworker.kernels.quant.block_fp8_matmul import GEMM_TABLE_KEY, BlockFp8GemmConfig, pick_config

    block_fp8_gemm = bench_script("block_fp8_gemm")
    small, large = BlockFp8GemmConfig(16, 64, 4, 5), BlockFp8GemmConfig(128, 128, 8, 3)
    tiles = {small.name: small, large.name: large}
    on_test_gpu(
        "block_fp8_matmul", GEMM_TABLE_KEY, block_fp8_gemm.config_records({16: small.name, 512: large.name}, tiles)
    )
    assert pick_config(3, on_cuda=True) == small
    assert pick_config(100, on_cuda=True) == large
    assert pick_config(9000, on_cuda=True) == large  # beyond the largest bucket: its tile


def test_sampling_records_each_batchs_fastest_config(bench_script, on_test_gpu):
    from gpuworker.kernels.sampling.sample import BASELINE_CONFIG, DEFAULT_CONFIG, TABLE_KEY, pick_config

    sampling = bench_script("sampling")
    on_test_gpu(
        "sample",
        TABLE_KEY,
        sampling.config_records({1: BASELINE_CONFIG.name, 512: DEFAULT_CONFIG.name}, [BASELINE_CONFIG, DEFAULT_CONFIG]),
    )
    assert pick_config(1) == BASELINE_CONFIG
    assert pick_config(2) == DEFAULT_CONFIG


def test_moe_decode_records_each_token_counts_choice(bench_script, on_test_gpu):
    from gpuworker.kernels.moe.decode import TABLE_KEY, decode_config

    moe_decode = bench_script("moe_decode")
    best = "gate_up=n8-k512-w4-p3,down=n4-k256-w2-p3"
    results = [{"M": 1, "best_config": best, "speedup": 1.5}, {"M": 4, "best_config": best, "speedup": 0.95}]
    on_test_gpu("moe_decode", TABLE_KEY, moe_decode.config_records(results))
    hidden, inter, top_k = moe_decode.HIDDEN, moe_decode.INTER, moe_decode.TOP_K
    assert decode_config(1, top_k, hidden, inter).name == best
    assert decode_config(3, top_k, hidden, inter) is None  # the grouped kernels won at 4


def test_kernel_times_records_a_decode_tile_per_kind_of_batch(bench_script, on_test_gpu):
    from gpuworker.kernels.attention.paged_decode import TABLE_KEY, default_tile

    kernel_times = bench_script("kernel_times")
    rows = [
        {"shape": shape, "batch": batch, "block_n": block_n, "num_warps": warps, "num_stages": stages, "us": us}
        for shape, batch, block_n, warps, stages, us in (
            ("B=512 a", 512, 128, 4, 3, 10.0),
            ("B=512 a", 512, 64, 8, 2, 12.0),
            ("B=256 b", 256, 128, 4, 3, 9.0),
            ("B=256 b", 256, 64, 8, 2, 8.0),
            ("B=256 b", 256, 32, 4, 1, 1.0),  # timed on one shape only: not a candidate
            ("B=1", 1, 64, 8, 2, 5.0),
            ("B=1", 1, 128, 4, 2, 6.0),
        )
    ]
    on_test_gpu("paged_decode", TABLE_KEY, kernel_times.decode_tile_records(rows, multiprocessors=132))
    assert default_tile(torch.bfloat16, 128, True) == (128, 4, 3)  # 19 us in all against 20
    assert default_tile(torch.bfloat16, 128, False) == (64, 8, 2)
    assert default_tile(torch.float16, 64, True) == (128, 4, 3)
    assert default_tile(torch.bfloat16, 256, True) == (32, 8, 2)  # beyond the swept head_dim: the default
