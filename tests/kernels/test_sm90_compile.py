"""Launches that the CPU tests run under the interpreter also compile for an H100/H200 (sm_90),
offline, with the arguments the launchers pass (tests/kernels/sm90_compile.py).

The INT4 GEMV's unsplit launch once passed a bfloat16 tensor as its ticket counter: the interpreter
never ran the split-K branch, but the compiler compiles it and rejects an atomic on bfloat16, so
every unsplit config failed on the H200 (bench/quant_gemv.py, 2026-12-02).
"""

from __future__ import annotations

import re

import pytest
import torch

from gpuworker.kernels.linear.activation import silu_and_mul_fp8
from gpuworker.kernels.norm.rms_norm import rms_norm_fp8
from gpuworker.kernels.quant import int4_matmul as int4_module
from gpuworker.kernels.quant.fp8_matmul import quantize_fp8_rows
from gpuworker.kernels.quant.int4_matmul import Int4GemvConfig, dequantize_int4_to, int4_matmul, pack_rows
from gpuworker.kernels.sampling.sample import BASELINE_CONFIG, DEFAULT_CONFIG, sample
from tests.kernels.sm90_compile import compile_sm90, record_launches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU compiles these itself")


def _int4_operands(n=64, k=256, group=128):
    g = torch.Generator().manual_seed(0)
    qweight = pack_rows(torch.randint(0, 16, (k, n), generator=g))
    zeros = torch.full((k // group, n), 8, dtype=torch.uint8)
    scales = torch.full((k // group, n), 0.01, dtype=torch.float16)
    return qweight, zeros, scales, group


@pytest.mark.parametrize("x_words", [False, True], ids=["x-values", "x-words"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_int4_gemv_compiles_unsplit_and_split(split_k, x_words, monkeypatch):
    launches = record_launches(monkeypatch)
    qweight, zeros, scales, group = _int4_operands()
    x = torch.randn(1, 256).to(torch.bfloat16)
    config = Int4GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=split_k, x_words=x_words)
    int4_matmul(x, qweight, zeros, scales, group, gemv_config=config)
    (launch,) = launches["_int4_gemv_kernel"]
    ptx = compile_sm90(launch)
    # x read as words: 32-bit loads only, and no 16-bit value widened by a conversion.
    assert ("cvt.u32.u16" in ptx) != x_words


@pytest.mark.parametrize("rows", [4, 12])
def test_int4_batched_matmul_compiles_with_the_gpu_tiles(rows, monkeypatch):
    # The interpreter runs small tiles; compile the tiles a GPU takes for these rows.
    monkeypatch.setattr(int4_module, "INTERPRETER_GEMM", int4_module.pick_gemm_config(rows, 128, on_cuda=True))
    launches = record_launches(monkeypatch)
    qweight, zeros, scales, group = _int4_operands(n=128)
    int4_matmul(torch.randn(rows, 256).to(torch.bfloat16), qweight, zeros, scales, group)
    (launch,) = launches["_int4_matmul_kernel"]
    compile_sm90(launch)


def test_int4_dequantize_compiles(monkeypatch):
    launches = record_launches(monkeypatch)
    qweight, zeros, scales, group = _int4_operands()
    dequantize_int4_to(qweight, zeros, scales, group, torch.bfloat16)
    (launch,) = launches["_dequantize_kernel"]
    compile_sm90(launch)


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_fp8_row_quantization_compiles(static, monkeypatch):
    launches = record_launches(monkeypatch)
    quantize_fp8_rows(torch.randn(3, 4096).to(torch.bfloat16), torch.tensor(0.1) if static else None, use_kernel=True)
    (launch,) = launches["_quantize_rows_kernel"]
    ptx = compile_sm90(launch)
    # Every FP8 GEMM's activations pass through here: 16 bytes a load, not a 16-bit value (with K
    # unspecialised, its row mask was unknown in every lane, and each value was loaded and stored alone).
    assert "ld.global.v4.b32" in ptx and "ld.global.b16" not in ptx and "st.global.b8" not in ptx
    # A 4,096-wide row is held in registers and read once: no loop (two loops, a read each, before).
    assert not re.search(r"\bbra\b", ptx)
    # Two divisions a row (the scale and its reciprocal), not one a value (16 a thread here: they
    # made it compute-bound, 16 us a launch at 512 rows on the H200).
    assert ptx.count("div.rn.f32") == (0 if static else 1) + 1


@pytest.mark.parametrize("config", [DEFAULT_CONFIG, BASELINE_CONFIG], ids=lambda config: config.name)
@pytest.mark.parametrize("outputs", ["num_kept", "num_passes"])
def test_sampling_compiles(config, outputs, monkeypatch):
    # One compiled kernel serves both one program per row and a row split over programs (the
    # split count is the grid's, read at run time); the interpreter always runs one per row.
    # Drawing first (max_draws > 0, no num_kept) and the threshold search are both compiled in.
    launches = record_launches(monkeypatch)
    rows, vocab = 3, 64
    output = torch.zeros(rows, dtype=torch.int32)
    sample(
        torch.randn(rows, vocab),
        torch.full((rows,), 0.8),
        seeds=torch.arange(rows),
        top_k=torch.full((rows,), vocab),
        top_p=torch.full((rows,), 0.9),
        min_p=torch.full((rows,), 0.05),
        config=config,
        **{outputs: output},
    )
    (launch,) = launches["_sample_kernel"]
    compile_sm90(launch)


def _decode_attention_ptx(monkeypatch, cache_dtype, fills_device, **kwargs) -> str:
    """The sm_90 PTX of a decode attention launch at Llama-3-8B's heads (32 query, 8 KV, 128 dims)
    with the tile the GPU takes for a batch that fills the device or not (bf16 queries)."""
    from gpuworker.kernels.attention.paged_decode import default_tile, paged_decode_attention

    launches = record_launches(monkeypatch)
    block_n, num_warps, num_stages = default_tile(torch.bfloat16, 128, fills_device)
    cache = torch.randn(2, 8, 16, 8, 128).to(cache_dtype)
    paged_decode_attention(
        torch.randn(2, 32, 128).bfloat16(),
        cache,
        torch.arange(8).reshape(2, 4).int(),
        torch.tensor([50, 64]).int(),
        0.088,
        64,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_splits=1 if fills_device else 2,
        **kwargs,
    )
    (launch,) = launches["_paged_decode_kernel"]
    return compile_sm90(launch)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("fills_device", [True, False], ids=["filled", "partitioned"])
def test_paged_decode_attention_compiles_with_the_gpu_tiles(cache_dtype, fills_device, monkeypatch):
    ptx = _decode_attention_ptx(monkeypatch, cache_dtype, fills_device)
    # Specialised as on the GPU, the tiles are copied to shared memory 16 bytes a thread at a time.
    assert "cp.async.cg.shared.global" in ptx


def test_fp8_values_read_as_words_are_not_gathered_a_byte_at_a_time(monkeypatch):
    # The P.V dot reads V across positions: an FP8 tile (no transposing ldmatrix for 8-bit values)
    # is gathered from shared memory with byte-wide loads, 128 a thread per 128-key tile; read as
    # 16-bit words and widened in registers, none.
    assert _decode_attention_ptx(monkeypatch, torch.float8_e4m3fn, True, fp8_v_pairs=False).count("ld.shared.b8") >= 64
    pairs = _decode_attention_ptx(monkeypatch, torch.float8_e4m3fn, True, fp8_v_pairs=True)
    assert pairs.count("ld.shared.b8") == 0
    # Both dots on float16 operands, as the byte path's (V widened once, not rounded on to bf16).
    assert ".f16.f16.f32" in pairs and ".bf16.bf16.f32" not in pairs


def test_fp8_outputs_of_norm_and_silu_and_mul_compile(monkeypatch):
    # The launches that quantize an FP8 projection's input themselves; row-wide, not looping.
    launches = record_launches(monkeypatch)
    x = torch.randn(3, 4096).to(torch.bfloat16)
    rms_norm_fp8(x, torch.ones(4096, dtype=torch.bfloat16), 1e-5, x.clone())
    silu_and_mul_fp8(torch.randn(3, 2 * 14336).to(torch.bfloat16))
    for name in ("_rms_norm_kernel", "_silu_and_mul_kernel"):
        (launch,) = launches[name]
        ptx = compile_sm90(launch)
        assert "st.global.b8" not in ptx and not re.search(r"\bbra\b", ptx)


@pytest.mark.parametrize(
    "routing, bias",
    [
        ("softmax-greedy", False),
        ("softmax-group-limited", False),
        ("sigmoid-noaux-tc-grouped", True),
    ],
)
def test_grouped_routing_compiles(routing, bias, monkeypatch):
    from gpuworker.kernels.moe.routing import GroupedRouting, route_grouped

    cases = {
        "softmax-greedy": GroupedRouting(top_k=6),
        "softmax-group-limited": GroupedRouting(
            top_k=6, topk_method="group_limited_greedy", n_group=8, topk_group=3, scaling=16.0
        ),
        "sigmoid-noaux-tc-grouped": GroupedRouting(
            top_k=8, topk_method="noaux_tc", n_group=8, topk_group=4, normalize=True, scaling=2.5
        ),
    }
    launches = record_launches(monkeypatch)
    logits = torch.randn(2, 256).to(torch.bfloat16)
    route_grouped(logits, cases[routing], torch.randn(256) if bias else None)
    (launch,) = launches["_route_grouped_kernel"]
    compile_sm90(launch)


@pytest.mark.parametrize("rows", [4, 40, 300])
def test_block_fp8_matmul_compiles_with_the_gpu_tiles(rows, monkeypatch):
    # The interpreter runs small tiles and float32 dots; compile the default tiles a GPU takes for
    # these rows, with FP8 x FP8 tensor-core products.
    from gpuworker.kernels.quant import block_fp8_matmul as block_module

    monkeypatch.setattr(block_module, "INTERPRETER_CONFIG", block_module.pick_config(rows, on_cuda=True))
    launches = record_launches(monkeypatch)
    x_q, x_scale = block_module.quantize_fp8_groups(torch.randn(rows, 1000).bfloat16(), 128, use_kernel=True)
    weight = torch.randn(200, 1000).to(torch.float8_e4m3fn)
    block_module.block_fp8_matmul(x_q, x_scale, weight, torch.ones(2, 8), 128, 128, out_dtype=torch.bfloat16)
    (launch,) = launches["_block_fp8_matmul_kernel"]
    # Decode rows split K (the interpreter's device counts 8 multiprocessors); batches do not.
    assert (launch.arguments["SPLIT_K"] > 1) == (rows <= 16)
    ptx = compile_sm90(launch)
    if launch.arguments["BLOCK_M"] >= 64:
        # A warpgroup's tile: FP8 x FP8 wgmma.
        assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", ptx)
    else:
        # Below wgmma's 64 rows Triton widens e4m3 to float16 (exact) for mma.sync; the weight is still
        # read as FP8, which is what a decode batch waits on.
        assert "cvt.rn.f16x2.e4m3x2" in ptx and re.search(r"mma\.sync\S*\.f32\.f16\.f16\.f32", ptx)


def test_group_quantization_compiles(monkeypatch):
    from gpuworker.kernels.quant.block_fp8_matmul import quantize_fp8_groups

    launches = record_launches(monkeypatch)
    quantize_fp8_groups(torch.randn(3, 7168).bfloat16(), 128, use_kernel=True)
    (launch,) = launches["_quantize_groups_kernel"]
    ptx = compile_sm90(launch)
    # 16-byte loads and no byte-at-a-time stores (K is specialised: its groups' masks are known).
    assert "ld.global.v4.b32" in ptx and "st.global.b8" not in ptx
    # Two divisions a group (its scale and the reciprocal), not one a value.
    assert ptx.count("div.rn.f32") <= 2 * 8


@pytest.mark.parametrize("tokens", [2, 64])
def test_block_fp8_moe_compiles(tokens, monkeypatch):
    # 16-row blocks for a few pairs an expert, 64 (FP8 wgmma) beyond.
    from gpuworker.kernels.moe.block_fp8 import fused_moe_block_fp8
    from tests.kernels.test_moe_block_fp8 import problem

    launches = record_launches(monkeypatch)
    fused_moe_block_fp8(*problem(tokens, 256, 128, 4, 2, (128, 128), torch.bfloat16), (128, 128))
    for name in ("_gate_up_kernel", "_down_kernel"):
        (launch,) = launches[name]
        ptx = compile_sm90(launch)
        if launch.arguments["BLOCK_M"] >= 64:
            assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", ptx), name


@pytest.mark.parametrize("rows", [4, 40, 300])
def test_int8_matmul_compiles_with_the_gpu_tiles(rows, monkeypatch):
    # The interpreter sums int32 products itself; compile the tiles a GPU takes for these rows, with
    # int8 x int8 -> int32 tensor-core products.
    from gpuworker.kernels.quant import int8_matmul as int8_module

    gpu_tiles = int8_module._tiles(rows, True)
    monkeypatch.setattr(int8_module, "_tiles", lambda m, on_cuda: gpu_tiles)
    launches = record_launches(monkeypatch)
    x_q, x_scale = int8_module.quantize_int8_rows(torch.randn(rows, 4096).bfloat16(), use_kernel=True)
    weight = torch.randint(-128, 128, (256, 4096), dtype=torch.int8)
    int8_module.int8_matmul(x_q, x_scale, weight, torch.ones(256), out_dtype=torch.bfloat16)
    ptx = compile_sm90(launches["_int8_matmul_kernel"][0])
    assert ".s32.s8.s8" in ptx  # integer MMAs (mma.sync or wgmma), not float products
    ptx = compile_sm90(launches["_quantize_int8_rows_kernel"][0])
    # Two divisions a row (the scale and its reciprocal), not one a value.
    assert ptx.count("div.rn.f32") == 2


@pytest.mark.parametrize("nope, rope, v_dim", [(128, 64, 128), (64, 32, 64)], ids=["deepseek", "small"])
def test_mla_prefill_compiles_with_the_gpu_tile(nope, rope, v_dim, monkeypatch):
    """The MLA prefill launch at DeepSeek's head dims (keys 128 + 64 with the rotary part shared by
    the heads, values 128), bf16, with the default tile: the dots on wgmma, the tiles' loads vectorised."""
    from gpuworker.kernels.attention.mla_prefill import mla_prefill_attention

    launches = record_launches(monkeypatch)
    heads = 2
    q = torch.randn(9, heads, nope + rope).bfloat16()
    kv = torch.randn(40, heads, nope + v_dim).bfloat16()
    k_rope = torch.randn(40, 1, rope).bfloat16().expand(-1, heads, -1)
    k_nope, values = kv.split([nope, v_dim], dim=-1)
    q_nope, q_rope = q.split([nope, rope], dim=-1)
    cu_q, cu_k = torch.tensor([0, 4, 9]).int(), torch.tensor([0, 30, 40]).int()
    mla_prefill_attention(q_nope, q_rope, k_nope, k_rope, values, cu_q, cu_k, 5, 0.1)
    (launch,) = launches["_mla_prefill_kernel"]
    assert launch.arguments["BLOCK_M"] == 64 and launch.arguments["stride_k_rope_head"] == 0
    ptx = compile_sm90(launch)
    assert re.search(r"wgmma\.mma_async\S*\.bf16\.bf16", ptx)
    # The strides are specialised (multiples of 16), so key and value tiles are copied to shared
    # memory 16 bytes a thread at a time.
    assert "cp.async.cg.shared.global" in ptx


@pytest.mark.parametrize("window", [0, 1024], ids=["full", "sliding"])
def test_prefill_attention_with_span_ends_compiles_with_the_gpu_tile(window, monkeypatch):
    """The prefill launch whose rows see to their span's end (Gemma 3's images), bf16 at head_dim
    128 with the default tile: the kv loop's bound is the tile's furthest span end, the dots on wgmma."""
    from gpuworker.kernels.attention.prefill import prefill_attention

    launches = record_launches(monkeypatch)
    heads, kv_heads, head_dim, block_size = 4, 2, 128, 16
    query = torch.randn(20, heads, head_dim).bfloat16()
    cache = torch.randn(2, 4, block_size, kv_heads, head_dim).bfloat16()
    tables = torch.arange(4, dtype=torch.int32).view(1, 4)
    span_ends = torch.arange(30, 50, dtype=torch.int32)
    span_ends[4:12] = 41
    qsl, seq_lens = torch.tensor([0, 20]).int(), torch.tensor([50]).int()
    prefill_attention(query, cache, qsl, seq_lens, tables, 0.1, 20, window=window, span_ends=span_ends)
    (launch,) = launches["_prefill_attention_kernel"]
    assert launch.arguments["SPANS"] and launch.arguments["BLOCK_M"] == 64
    assert re.search(r"wgmma\.mma_async\S*\.bf16\.bf16", compile_sm90(launch))
