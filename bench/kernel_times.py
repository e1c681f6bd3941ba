"""Kernel benchmark: each Triton kernel against its torch equivalent at Llama-3-8B shapes, on one GPU.

    PYTHONPATH=. python bench/kernel_times.py [--quick] [--no-sweep] [--batch1-decode-only] [--fp8-decode-only]
    PYTHONPATH=. python bench/kernel_times.py --write-configs   # and merge the decode tiles into configs/

Every figure is the median per-call time of a CUDA graph that replays the call over enough distinct
input sets (different caches / activations) that the data cannot stay in L2, as 32 layers do in a
real step; launch overhead is out of the numbers. Decode attention is reported in GB/s of KV read
against the device's measured copy bandwidth, prefill in TFLOP/s, the rest in GB/s. Writes
kernels.json to $OUT (or bench/results/); with --write-configs the decode attention's fastest tiles, for
batches that fill the device and for those that do not, go to
gpuworker/kernels/configs/paged_decode/<this GPU>.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import add_write_configs_option, copy_bandwidth_gbs, environment, write_configs, write_json
from gpuworker.kernels.attention.kv_cache_write import kv_cache_write
from gpuworker.kernels.attention.paged_decode import (
    TABLE_KEY,
    NewTokens,
    SplitCounters,
    choose_num_splits,
    multiprocessor_count,
    paged_decode_attention,
)
from gpuworker.kernels.attention.prefill import prefill_attention
from gpuworker.kernels.attention.rotary import apply_rotary, apply_rotary_and_cache, apply_rotary_reference
from gpuworker.kernels.norm.rms_norm import rms_norm, rms_norm_reference
from gpuworker.models.layers import RotaryEmbedding

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, BLOCK_SIZE = 32, 8, 128, 4096, 16
DTYPE = torch.bfloat16
ES = 2  # bytes per bf16 element
L2_FLUSH_BYTES = 256 << 20  # several times the H200's 60 MB L2


def num_sets(bytes_per_call: int, cap: int = 32) -> int:
    return max(2, min(cap, math.ceil(L2_FLUSH_BYTES / max(1, bytes_per_call))))


def graph_time_us(calls: list[Callable[[], object]], replays: int = 15) -> float:
    """Median per-call device time of one CUDA graph holding every call once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles kernels, settles allocations
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def eager_time_us(call: Callable[[], object], iters: int = 200) -> float:
    """Wall time per call issued back to back from Python: what a step without graphs pays."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def randn(*shape, dtype=DTYPE):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- decode attention


def decode_inputs(batch: int, context: int):
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * ES
    sets = num_sets(kv_bytes)
    cache = randn(2, sets * batch * blocks_per_seq + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    order = torch.randperm(sets * batch * blocks_per_seq, device="cuda").int() + 1
    tables = order.view(sets, batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = [randn(batch, NUM_Q_HEADS, HEAD_DIM) for _ in range(sets)]
    out = torch.empty_like(query[0])
    # Dense equivalent for SDPA: contiguous [B, H, L, D] keys/values, no paging.
    return cache, tables, seq_lens, query, out, kv_bytes, sets


def bench_decode_batch1(contexts=(128, 384, 640, 1024), max_lens=(2048, 8192), layers=32) -> list[dict]:
    """Batch-1 decode attention as the engine's decode graph runs it: one launch per layer, each layer
    its own cache, the graph captured for max_len (the engine's max_model_len) and replayed on shorter
    contexts. The two ways of merging the partitions side by side (the launcher picks the merge kernel
    at this batch size); the per-launch figure includes the gap between launches, as in a step."""
    blocks = math.ceil(max(contexts) / BLOCK_SIZE)
    caches = [randn(2, blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(layers)]
    query = randn(1, NUM_Q_HEADS, HEAD_DIM)
    counters = SplitCounters().get(NUM_KV_HEADS, query.device)
    rows = []
    for max_len in max_lens:
        tables = torch.zeros(1, math.ceil(max_len / BLOCK_SIZE), dtype=torch.int32, device="cuda")
        tables[0, :blocks] = torch.arange(1, blocks + 1, dtype=torch.int32, device="cuda")
        for context in contexts:
            seq_lens = torch.tensor([context], dtype=torch.int32, device="cuda")
            row = {
                "context": context,
                "max_len": max_len,
                "num_splits": choose_num_splits(1, NUM_KV_HEADS, max_len, query.device),
            }
            for key, merge_in_launch, block_n in (
                ("in_launch_us", True, None),
                ("merge_kernel_us", False, None),
                ("merge_kernel_n32_us", False, 32),
            ):
                calls = [
                    lambda cache=cache, merge=merge_in_launch, n=block_n: paged_decode_attention(
                        query,
                        cache,
                        tables,
                        seq_lens,
                        HEAD_DIM**-0.5,
                        max_len,
                        counters=counters,
                        merge_in_launch=merge,
                        block_n=n,
                    )
                    for cache in caches
                ]
                row[key] = graph_time_us(calls)
            rows.append(row)
    return rows


def bench_decode_new_tokens(
    cases=((1, 128, 128, 8192, 32), (1, 384, 384, 8192, 32), (1, 640, 640, 8192, 32), (512, 200, 2048, 2048, 4)),
) -> list[dict]:
    """Rotary + cache write as their own kernel before the decode launch, against the decode launch
    doing both (new_tokens), as a layer of a decode graph runs them: per case (batch, contexts
    uniform in [lo, hi], max_len the graph is captured for, layers each with its own cache)."""
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 500000.0, None).cuda()
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    scale = HEAD_DIM**-0.5
    rows = []
    for batch, lo, hi, max_len, layers in cases:
        lens = torch.randint(lo, hi + 1, (batch,), device="cuda", dtype=torch.int32)
        blocks_per_seq = math.ceil(max_len / BLOCK_SIZE)
        caches = [randn(2, batch * blocks_per_seq + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(layers)]
        tables = (torch.randperm(batch * blocks_per_seq, device="cuda").int() + 1).view(batch, blocks_per_seq)
        qkv = randn(batch, q_size + 2 * kv_size)
        query = qkv[:, :q_size].view(batch, NUM_Q_HEADS, HEAD_DIM)
        key = qkv[:, q_size : q_size + kv_size].view(batch, NUM_KV_HEADS, HEAD_DIM)
        value = qkv[:, q_size + kv_size :].view(batch, NUM_KV_HEADS, HEAD_DIM)
        positions = (lens - 1).long()
        slots = (
            tables.gather(1, (positions // BLOCK_SIZE)[:, None]).squeeze(1).long() * BLOCK_SIZE + positions % BLOCK_SIZE
        )
        counters = SplitCounters().get(batch * NUM_KV_HEADS, query.device)
        out = torch.empty_like(query)
        new_tokens = NewTokens(positions, key, value, rotary.cos_cache, rotary.sin_cache, slots)

        def separate(cache):
            apply_rotary_and_cache(positions, query, key, value, rotary.cos_cache, rotary.sin_cache, cache, slots)
            paged_decode_attention(query, cache, tables, lens, scale, max_len, out=out, counters=counters)

        def fused(cache):
            paged_decode_attention(
                query, cache, tables, lens, scale, max_len, out=out, counters=counters, new_tokens=new_tokens
            )

        rows.append(
            {
                "batch": batch,
                "contexts": f"{lo}-{hi}",
                "max_len": max_len,
                "separate_us": graph_time_us([lambda c=c: separate(c) for c in caches]),
                "fused_us": graph_time_us([lambda c=c: fused(c) for c in caches]),
            }
        )
        del caches
        torch.cuda.empty_cache()
    return rows


def bench_decode_tiles_mixed(cases=((512, 200, 2048), (256, 200, 2048), (512, 600, 1200))) -> list[dict]:
    """Tile sweep of the decode kernel on large batches of uneven contexts (the offline regime):
    block_n x warps x stages, per case (batch, contexts uniform in [lo, hi])."""
    rows = []
    scale = HEAD_DIM**-0.5
    for batch, lo, hi in cases:
        lens = torch.randint(lo, hi + 1, (batch,), device="cuda", dtype=torch.int32)
        max_len = int(lens.max())
        blocks_per_seq = math.ceil(max_len / BLOCK_SIZE)
        kv_bytes = 2 * int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * ES
        sets = min(4, num_sets(kv_bytes))
        cache = randn(2, sets * batch * blocks_per_seq + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        tables = (torch.randperm(sets * batch * blocks_per_seq, device="cuda").int() + 1).view(
            sets, batch, blocks_per_seq
        )
        query = [randn(batch, NUM_Q_HEADS, HEAD_DIM) for _ in range(sets)]
        out = torch.empty_like(query[0])
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3, 4):
                    us = graph_time_us(
                        [
                            (
                                lambda i=i: paged_decode_attention(
                                    query[i],
                                    cache,
                                    tables[i],
                                    lens,
                                    scale,
                                    max_len,
                                    out=out,
                                    block_n=block_n,
                                    num_warps=warps,
                                    num_stages=stages,
                                )
                            )
                            for i in range(sets)
                        ]
                    )
                    rows.append(
                        {
                            "shape": f"B={batch} ctx U[{lo},{hi}]",
                            "batch": batch,
                            "block_n": block_n,
                            "num_warps": warps,
                            "num_stages": stages,
                            "us": us,
                            "GBps": kv_bytes / us / 1e3,
                        }
                    )
        # Rebound to None rather than deleted: ruff reads a name deleted after a lambda or closure that
        # uses it as undefined there (F821); the memory goes back all the same.
        cache = None
        torch.cuda.empty_cache()
    return rows


def bench_decode_fp8(
    cases=((512, 700), (256, 1024), (64, 2048)),
    tiles=((64, 4, 2), (64, 8, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3), (64, 8, 3)),
) -> list[dict]:
    """Decode attention over an FP8 cache (float8_e4m3fn, per-tensor scales) against the same
    values in a bf16 cache, at the default launch and over a tile sweep for FP8, each tile with V
    read as bytes and as 16-bit words ("+pairs", paged_decode_attention's fp8_v_pairs), per case
    (batch, context). GB/s counts the bytes each cache holds for the context (FP8: half of bf16's)."""
    from gpuworker.kernels.quant.kv_cache import FP8_DTYPE

    rows = []
    scale = HEAD_DIM**-0.5
    k_scale, v_scale = 0.02, 0.015
    for batch, context in cases:
        cache, tables, seq_lens, query, out, kv_bytes, sets = decode_inputs(batch, context)
        cache_fp8 = torch.empty_like(cache, dtype=FP8_DTYPE)
        cache_fp8[0] = (cache[0].float() / k_scale).clamp(-448, 448).to(FP8_DTYPE)
        cache_fp8[1] = (cache[1].float() / v_scale).clamp(-448, 448).to(FP8_DTYPE)

        def timed(kv_cache, **kw):
            fp8 = kv_cache.dtype == FP8_DTYPE
            scales = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
            return graph_time_us(
                [
                    (
                        lambda i=i: paged_decode_attention(
                            query[i], kv_cache, tables[i], seq_lens, scale, context, out=out, **scales, **kw
                        )
                    )
                    for i in range(sets)
                ]
            )

        bf16_us = timed(cache)
        fp8_us = timed(cache_fp8)
        shape = f"B={batch} ctx={context}"
        rows.append(
            {"shape": shape, "cache": "bf16", "tile": "default", "us": bf16_us, "GBps": kv_bytes / bf16_us / 1e3}
        )
        rows.append(
            {
                "shape": shape,
                "cache": "fp8",
                "tile": "default",
                "us": fp8_us,
                "GBps": kv_bytes / 2 / fp8_us / 1e3,
                "vs_bf16": bf16_us / fp8_us,
            }
        )
        for block_n, warps, stages in tiles:
            for v_pairs in (False, True):  # V read as bytes (the default) or as 16-bit words
                us = timed(cache_fp8, block_n=block_n, num_warps=warps, num_stages=stages, fp8_v_pairs=v_pairs)
                rows.append(
                    {
                        "shape": shape,
                        "cache": "fp8",
                        "tile": f"{block_n}x{warps}w{stages}s" + ("+pairs" if v_pairs else ""),
                        "us": us,
                        "GBps": kv_bytes / 2 / us / 1e3,
                        "vs_bf16": bf16_us / us,
                    }
                )
        del cache, cache_fp8
        torch.cuda.empty_cache()
    return rows


def bench_decode(shapes, configs, split_options) -> tuple[list[dict], list[dict]]:
    rows, sweep = [], []
    scale = HEAD_DIM**-0.5
    for batch, context in shapes:
        cache, tables, seq_lens, query, out, kv_bytes, sets = decode_inputs(batch, context)

        def call(i, **kw):
            return lambda: paged_decode_attention(query[i], cache, tables[i], seq_lens, scale, context, out=out, **kw)

        us = graph_time_us([call(i) for i in range(sets)])
        eager = eager_time_us(call(0))
        splits = choose_num_splits(batch, NUM_KV_HEADS, context, cache.device)
        cache = None
        sdpa_us = None
        try:
            dense_sets = num_sets(kv_bytes, cap=8)
            k = [randn(batch, NUM_KV_HEADS, context, HEAD_DIM) for _ in range(dense_sets)]
            v = [randn(batch, NUM_KV_HEADS, context, HEAD_DIM) for _ in range(dense_sets)]
            q = randn(batch, NUM_Q_HEADS, 1, HEAD_DIM)
            sdpa_us = graph_time_us(
                [
                    (lambda i=i: F.scaled_dot_product_attention(q, k[i], v[i], scale=scale, enable_gqa=True))
                    for i in range(dense_sets)
                ]
            )
            k = v = None
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            print(f"  sdpa decode {batch}x{context}: {exc!r}")
        rows.append(
            {
                "kernel": "paged_decode_attention",
                "shape": f"B={batch} ctx={context}",
                "splits": splits,
                "us": us,
                "eager_us": eager,
                "kv_bytes": kv_bytes,
                "GBps": kv_bytes / us / 1e3,
                "baseline": "torch SDPA (dense contiguous KV, enable_gqa)",
                "baseline_us": sdpa_us,
                "baseline_GBps": kv_bytes / sdpa_us / 1e3 if sdpa_us else None,
            }
        )
        torch.cuda.empty_cache()

    sweep_shapes = list(dict.fromkeys([*configs["shapes"], *split_options]))
    for batch, context in sweep_shapes:
        cache, tables, seq_lens, query, out, kv_bytes, sets = decode_inputs(batch, context)
        tiles = configs["tiles"] if (batch, context) in configs["shapes"] else []
        for block_n, warps, stages in tiles:
            us = graph_time_us(
                [
                    (
                        lambda i=i: paged_decode_attention(
                            query[i],
                            cache,
                            tables[i],
                            seq_lens,
                            scale,
                            context,
                            out=out,
                            block_n=block_n,
                            num_warps=warps,
                            num_stages=stages,
                        )
                    )
                    for i in range(sets)
                ]
            )
            sweep.append(
                {
                    "kernel": "paged_decode_attention",
                    "shape": f"B={batch} ctx={context}",
                    "batch": batch,
                    "block_n": block_n,
                    "num_warps": warps,
                    "num_stages": stages,
                    "us": us,
                    "GBps": kv_bytes / us / 1e3,
                }
            )
        for splits in split_options.get((batch, context), []):
            us = graph_time_us(
                [
                    (
                        lambda i=i: paged_decode_attention(
                            query[i], cache, tables[i], seq_lens, scale, context, out=out, num_splits=splits
                        )
                    )
                    for i in range(sets)
                ]
            )
            sweep.append(
                {
                    "kernel": "paged_decode_attention",
                    "shape": f"B={batch} ctx={context}",
                    "num_splits": splits,
                    "us": us,
                    "GBps": kv_bytes / us / 1e3,
                }
            )
        cache = None
        torch.cuda.empty_cache()
    return rows, sweep


# ---------------------------------------------------------------- prefill attention


def prefill_case(num_seqs: int, q_len: int, prefix: int):
    context = prefix + q_len
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    cache = randn(2, num_seqs * blocks_per_seq + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    tables = (torch.randperm(num_seqs * blocks_per_seq, device="cuda").int() + 1).view(num_seqs, blocks_per_seq)
    query = randn(num_seqs * q_len, NUM_Q_HEADS, HEAD_DIM)
    qsl = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * q_len
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    # 2 flops per multiply-add, QK^T and PV: query i sees prefix + i + 1 keys.
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * num_seqs * (q_len * prefix + q_len * (q_len + 1) // 2)
    return cache, tables, query, qsl, seq_lens, flops


def bench_prefill(shapes, tiles) -> tuple[list[dict], list[dict]]:
    rows, sweep = [], []
    scale = HEAD_DIM**-0.5
    for num_seqs, q_len, prefix in shapes:
        cache, tables, query, qsl, seq_lens, flops = prefill_case(num_seqs, q_len, prefix)
        out = torch.empty_like(query)

        def run(**kw):
            return prefill_attention(query, cache, qsl, seq_lens, tables, scale, q_len, out=out, **kw)

        us = graph_time_us([run] * 3)
        sdpa_us = None
        try:
            from torch.nn.attention.bias import causal_lower_right

            q = randn(num_seqs, NUM_Q_HEADS, q_len, HEAD_DIM)
            k = randn(num_seqs, NUM_KV_HEADS, prefix + q_len, HEAD_DIM)
            v = randn(num_seqs, NUM_KV_HEADS, prefix + q_len, HEAD_DIM)
            if prefix == 0:
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731
            else:
                mask = causal_lower_right(q_len, prefix + q_len)
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)  # noqa: E731
            sdpa_us = graph_time_us([sdpa] * 3)
        except Exception as exc:  # noqa: BLE001
            print(f"  sdpa prefill {num_seqs}x{q_len}+{prefix}: {exc!r}")
        shape = f"{num_seqs}x{q_len}" + (f" after {prefix} cached" if prefix else "")
        rows.append(
            {
                "kernel": "prefill_attention",
                "shape": shape,
                "us": us,
                "TFLOPs": flops / us / 1e6,
                "baseline": "torch SDPA (dense, causal, enable_gqa)",
                "baseline_us": sdpa_us,
                "baseline_TFLOPs": flops / sdpa_us / 1e6 if sdpa_us else None,
            }
        )
        if (num_seqs, q_len, prefix) in tiles["shapes"]:
            for block_m, block_n, warps, stages in tiles["tiles"]:
                try:
                    t = graph_time_us(
                        [lambda: run(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)] * 3
                    )
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for a large tile
                    print(f"  prefill tile {block_m}x{block_n} w{warps} s{stages}: {exc!r}")
                    continue
                sweep.append(
                    {
                        "kernel": "prefill_attention",
                        "shape": shape,
                        "block_m": block_m,
                        "block_n": block_n,
                        "num_warps": warps,
                        "num_stages": stages,
                        "us": t,
                        "TFLOPs": flops / t / 1e6,
                    }
                )
        cache = None
        torch.cuda.empty_cache()
    return rows, sweep


# ---------------------------------------------------------------- memory-bound helpers


def bench_small(token_counts) -> list[dict]:
    rows = []
    for tokens in token_counts:
        # kv_cache_write: read k and v, write them into a cache with shuffled slots.
        moved = 2 * 2 * tokens * NUM_KV_HEADS * HEAD_DIM * ES
        sets = num_sets(moved)
        num_slots = max(tokens * sets, 1024) * 2
        cache = randn(2, num_slots // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        keys = [randn(tokens, NUM_KV_HEADS, HEAD_DIM) for _ in range(sets)]
        slots = torch.randperm(num_slots, device="cuda")[: tokens * sets].view(sets, tokens)
        flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)

        def torch_write(i):
            flat[0][slots[i]] = keys[i]
            flat[1][slots[i]] = keys[i]

        rows.append(
            _row(
                "kv_cache_write",
                f"T={tokens}",
                moved,
                [lambda i=i: kv_cache_write(keys[i], keys[i], cache, slots[i]) for i in range(sets)],
                [lambda i=i: torch_write(i) for i in range(sets)],
                "torch index_put",
            )
        )
        cache = None

        # rms_norm with residual: read x, residual; write out, new residual.
        moved = 4 * tokens * HIDDEN * ES
        sets = num_sets(moved)
        xs = [randn(tokens, HIDDEN) for _ in range(sets)]
        rs = [randn(tokens, HIDDEN) for _ in range(sets)]
        weight = randn(HIDDEN)
        rows.append(
            _row(
                "rms_norm+residual",
                f"T={tokens} H={HIDDEN}",
                moved,
                [lambda i=i: rms_norm(xs[i], weight, 1e-5, rs[i]) for i in range(sets)],
                [lambda i=i: rms_norm_reference(xs[i], weight, 1e-5, rs[i]) for i in range(sets)],
                "torch eager ops (HF numerics)",
            )
        )
        xs = rs = None

        # rotary on q and k views of a fused qkv output, in place.
        moved = 2 * tokens * (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM * ES
        sets = num_sets(moved)
        qkv = [randn(tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM) for _ in range(sets)]
        qs = [x[:, : NUM_Q_HEADS * HEAD_DIM].view(tokens, NUM_Q_HEADS, HEAD_DIM) for x in qkv]
        ks = [
            x[:, NUM_Q_HEADS * HEAD_DIM : (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(tokens, NUM_KV_HEADS, HEAD_DIM)
            for x in qkv
        ]
        positions = torch.randint(0, 8192, (tokens,), device="cuda")
        freqs = torch.arange(8192, device="cuda").float()[:, None] * torch.rand(HEAD_DIM // 2, device="cuda")[None]
        cos, sin = freqs.cos(), freqs.sin()
        rows.append(
            _row(
                "rotary",
                f"T={tokens}",
                moved,
                [lambda i=i: apply_rotary(positions, qs[i], ks[i], cos, sin) for i in range(sets)],
                [lambda i=i: apply_rotary_reference(positions, qs[i], ks[i], cos, sin) for i in range(sets)],
                "torch eager ops (HF numerics)",
            )
        )
        qkv = qs = ks = None
        torch.cuda.empty_cache()
    return rows


def _row(kernel, shape, moved, triton_calls, torch_calls, baseline) -> dict:
    us = graph_time_us(triton_calls)
    base = graph_time_us(torch_calls)
    return {
        "kernel": kernel,
        "shape": shape,
        "us": us,
        "eager_us": eager_time_us(triton_calls[0]),
        "GBps": moved / us / 1e3,
        "baseline": baseline,
        "baseline_us": base,
        "baseline_GBps": moved / base / 1e3,
    }


# ---------------------------------------------------------------- main


def print_rows(title: str, rows: list[dict], unit: str, copy_gbps: float) -> None:
    print(f"\n== {title} ==")
    print(
        f"{'kernel':24s} {'shape':26s} {'triton us':>10s} {unit:>9s} {'%copy':>6s} {'torch us':>10s} "
        f"{'torch ' + unit:>11s} {'speedup':>8s}"
    )
    for r in rows:
        us, value = r["us"], r[unit]
        base_us, base_value = r.get("baseline_us"), r.get("baseline_" + unit)
        pct = f"{100 * value / copy_gbps:5.0f}%" if unit == "GBps" else ""
        base_cols = (
            f"{base_us:10.1f} {base_value:11.1f} {base_us / us:7.2f}x"
            if base_us
            else f"{'-':>10s} {'-':>11s} {'-':>8s}"
        )
        print(f"{r['kernel'][:24]:24s} {r['shape'][:26]:26s} {us:10.1f} {value:9.1f} {pct:>6s} {base_cols}")


def decode_tile_records(tile_rows: list[dict], multiprocessors: int) -> list[dict]:
    """gpuworker/kernels/configs/paged_decode's records (bf16, Llama-3-8B's head_dim): for batches
    whose programs (batch x kv heads) fill the multiprocessors and for those that do not, the tile
    with the least total time over the swept shapes of that kind that timed every tile."""
    records = []
    for fills in (True, False):
        rows = [r for r in tile_rows if "block_n" in r and (r["batch"] * NUM_KV_HEADS >= multiprocessors) == fills]
        tiles = {(r["block_n"], r["num_warps"], r["num_stages"]) for r in rows}
        shapes = {r["shape"] for r in rows}
        totals = {}
        for tile in tiles:
            times = [r["us"] for r in rows if (r["block_n"], r["num_warps"], r["num_stages"]) == tile]
            if len(times) == len(shapes):
                totals[tile] = sum(times)
        if totals:
            block_n, num_warps, num_stages = min(totals, key=totals.get)
            batches = "batches that fill the device" if fills else "small batches"
            records.append(
                {
                    "dtype": "bfloat16",
                    "max_head_dim": HEAD_DIM,
                    "fills_device": fills,
                    "block_n": block_n,
                    "num_warps": num_warps,
                    "num_stages": num_stages,
                    "note": f"llama-3-8b heads, {batches}",
                }
            )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile/split sweeps")
    parser.add_argument(
        "--batch1-decode-only",
        action="store_true",
        help="only the decode-graph probes: batch-1 merges, rotary fused into the launch or not",
    )
    parser.add_argument(
        "--fp8-decode-only",
        action="store_true",
        help="only decode attention over an FP8 cache against bf16, with FP8 tile sweep",
    )
    add_write_configs_option(parser, "gpuworker/kernels/configs/paged_decode (the decode tiles)")
    args = parser.parse_args()
    if args.write_configs and (args.no_sweep or args.batch1_decode_only or args.fp8_decode_only):
        parser.error(
            "--write-configs needs the tile sweeps (not --no-sweep, --batch1-decode-only or --fp8-decode-only)"
        )
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_times.py needs a CUDA device")
    torch.manual_seed(0)
    env = environment()
    copy_gbps = copy_bandwidth_gbs()
    print(
        f"{env.get('gpu')}  torch {env.get('torch')}  triton {env.get('triton')}  "
        f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)"
    )

    decode_shapes = [
        (1, 1024),
        (1, 4096),
        (1, 16384),
        (8, 4096),
        (32, 2048),
        (64, 1024),
        (128, 2048),
        (256, 1024),
        (256, 2048),
    ]
    prefill_shapes = [(1, 4096, 0), (8, 1024, 0), (16, 512, 0), (4, 512, 1536), (1, 2048, 6144)]
    small_tokens = [1, 256, 8192]
    if args.quick:
        decode_shapes, prefill_shapes, small_tokens = decode_shapes[::3], prefill_shapes[:2], [256]
    decode_sweep = {
        "shapes": [] if args.no_sweep else [(1, 16384), (256, 1024)],
        "tiles": [(64, 4, 2), (64, 8, 2), (128, 4, 2), (128, 8, 2)],
    }
    split_options = {} if args.no_sweep else {(1, 1024): [4, 8, 16], (1, 4096): [16, 32, 64], (64, 1024): [1, 2, 4]}
    prefill_tiles = {
        "shapes": [] if args.no_sweep else [(1, 4096, 0), (4, 512, 1536)],
        "tiles": [(64, 64, 4, 2), (64, 128, 4, 2), (64, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 3)],
    }

    payload = {
        "environment": env,
        "copy_bandwidth_GBps": copy_gbps,
        "dtype": str(DTYPE),
        "model_shape": {
            "num_q_heads": NUM_Q_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "hidden": HIDDEN,
            "block_size": BLOCK_SIZE,
        },
    }
    if args.fp8_decode_only:
        payload["decode_fp8"] = fp8_rows = bench_decode_fp8()
        print(f"\n== decode attention, FP8 cache vs bf16 (copy bandwidth {copy_gbps:.0f} GB/s) ==")
        for r in fp8_rows:
            versus = f"  {r['vs_bf16']:.2f}x bf16's speed" if "vs_bf16" in r else ""
            print(f"{r['shape']:16s} {r['cache']:5s} {r['tile']:16s} {r['us']:9.1f} us {r['GBps']:6.0f} GB/s{versus}")
        write_json("kernels_fp8_decode", payload)
        return
    payload["decode_batch1_graph"] = batch1 = bench_decode_batch1()
    print("\n== batch-1 paged decode in a graph of 32 layers' launches (us per launch) ==")
    print(
        f"{'context':>8s} {'max_len':>8s} {'splits':>7s} {'in-launch merge':>16s} {'merge kernel':>13s} "
        f"{'merge kernel, 32-token tiles':>29s}"
    )
    for r in batch1:
        print(
            f"{r['context']:8d} {r['max_len']:8d} {r['num_splits']:7d} {r['in_launch_us']:16.2f} "
            f"{r['merge_kernel_us']:13.2f} {r['merge_kernel_n32_us']:29.2f}"
        )
    payload["decode_new_tokens"] = fused = bench_decode_new_tokens()
    print("\n== rotary + cache write: own kernel before the decode launch vs inside it (us per layer) ==")
    for r in fused:
        print(
            f"B={r['batch']:4d} ctx {r['contexts']:>9s} max_len {r['max_len']:5d}: separate "
            f"{r['separate_us']:8.2f}  fused {r['fused_us']:8.2f}"
        )
    write_json("kernels", payload)
    if args.batch1_decode_only:
        return
    if not args.no_sweep:
        payload["decode_tiles_mixed"] = tiles = bench_decode_tiles_mixed()
        print("\n== decode tiles, large batches of uneven contexts (fastest 4 per shape) ==")
        for shape in dict.fromkeys(r["shape"] for r in tiles):
            for r in sorted((r for r in tiles if r["shape"] == shape), key=lambda r: r["us"])[:4]:
                print(
                    f"{shape}: block_n {r['block_n']:3d} warps {r['num_warps']} stages {r['num_stages']}: "
                    f"{r['us']:8.1f} us {r['GBps']:6.0f} GB/s"
                )
        write_json("kernels", payload)
    decode_rows, decode_sweep_rows = bench_decode(decode_shapes, decode_sweep, split_options)
    payload["decode"], payload["decode_sweep"] = decode_rows, decode_sweep_rows
    write_json("kernels", payload)
    if args.write_configs:
        # Batches that fill the device from the uneven-context sweep (every tile), small ones from the
        # decode sweep's.
        fills = multiprocessor_count(torch.device("cuda"))
        small = [r for r in decode_sweep_rows if "block_n" in r and r["batch"] * NUM_KV_HEADS < fills]
        write_configs("paged_decode", TABLE_KEY, decode_tile_records(payload["decode_tiles_mixed"] + small, fills))
    prefill_rows, prefill_sweep_rows = bench_prefill(prefill_shapes, prefill_tiles)
    payload["prefill"], payload["prefill_sweep"] = prefill_rows, prefill_sweep_rows
    write_json("kernels", payload)
    payload["small"] = bench_small(small_tokens)
    write_json("kernels", payload)

    for r in decode_sweep_rows + prefill_sweep_rows:
        print("  sweep", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
    print_rows("memory-bound helpers (bf16)", payload["small"], "GBps", copy_gbps)
    print_rows("prefill attention (bf16, Llama-3-8B heads)", prefill_rows, "TFLOPs", copy_gbps)
    print_rows(
        f"paged decode attention (bf16, 32q/8kv heads, block {BLOCK_SIZE}; copy {copy_gbps:.0f} GB/s)",
        decode_rows,
        "GBps",
        copy_gbps,
    )


if __name__ == "__main__":
    main()
