"""MLA decode benchmark and tile sweep: the Triton MLA decode kernel (gpuworker.kernels.attention.mla_decode)
at DeepSeek-V2-Lite's (16 heads) and DeepSeek-V3's (128 heads) latent attention, kv_lora_rank 512 and
rope 64, bf16, batch 1 to 256 and contexts of 1k and 4k tokens, on one GPU.

    PYTHONPATH=. python bench/mla_decode.py [--quick] [--write-configs]
    PYTHONPATH=. python bench/mla_decode.py --check-only    # no timing; on a CPU: tiny shapes, float32,
                                                            # the Triton interpreter

Every candidate tile is first checked against mla_decode_reference; one that disagrees is reported
and skipped. Times are medians of CUDA-graph replays over several copies of the cache, so the L2 does
not hold one call's context for the next; GB/s counts the latent rows read (576 values per token).
The tile with the lowest geometric mean time over the grid wins; --write-configs merges it into
gpuworker/kernels/configs/mla_decode/<this GPU>.json, which the kernel reads at run time (the
defaults in MLADecodeConfig serve GPUs without a file). Writes mla_decode.json (mla_decode_check.json
with --check-only) to $OUT (or bench/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from common import add_write_configs_option, pick_tile, start_kernel_sweep, write_configs, write_json

KV_RANK, ROPE = 512, 64
HEADS = (16, 128)  # DeepSeek-V2-Lite, DeepSeek-V3
BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 4096)
BLOCK_SIZE = 16
# Tiny shapes for --check-only on a CPU: ragged contexts, heads below and above a head tile.
TINY = {"kv_rank": 32, "rope": 16, "heads": (4, 20), "batches": (1, 3), "contexts": (40, 97)}


def candidates(quick: bool) -> list:
    from gpuworker.kernels.attention.mla_decode import DEFAULT_CONFIG, MLADecodeConfig

    tiles = [DEFAULT_CONFIG]
    for block_h in (16, 32):
        for block_n in (16, 32, 64):
            for num_warps, num_stages in ((4, 2), (8, 2), (4, 3)):
                for split_tokens in (256, 512, 1024):
                    tile = MLADecodeConfig(block_h, block_n, split_tokens, num_warps, num_stages)
                    if tile not in tiles:
                        tiles.append(tile)
    if quick:
        return tiles[:: max(1, len(tiles) // 8)]
    return tiles


def name(tile) -> str:
    return f"h{tile.block_h}-n{tile.block_n}-s{tile.split_tokens}-w{tile.num_warps}-p{tile.num_stages}"


def make_inputs(batch: int, heads: int, context: int, kv_rank: int, rope: int, dtype, device: str, copies: int):
    generator = torch.Generator(device=device).manual_seed(batch * 31 + context)
    blocks = math.ceil(context / BLOCK_SIZE)
    width = kv_rank + rope
    cache = torch.randn(copies * batch * blocks + 1, BLOCK_SIZE, width, device=device, generator=generator).to(dtype)
    order = torch.randperm(copies * batch * blocks, device=device, generator=generator).int() + 1
    tables = order.view(copies, batch, blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    queries = [torch.randn(batch, heads, width, device=device, generator=generator).to(dtype) for _ in range(copies)]
    return cache, tables, seq_lens, queries


def measure(tile, shape: dict, cache_inputs: dict, *, device: str, timed: bool) -> dict:
    from gpuworker.kernels.attention.mla_decode import mla_decode, mla_decode_reference

    key = (shape["batch"], shape["heads"], shape["context"])
    cache, tables, seq_lens, queries = cache_inputs[key]
    kv_rank, scale = shape["kv_rank"], 1 / math.sqrt(192)
    row = {**shape, "config": name(tile)}
    out = mla_decode(queries[0], cache, tables[0], seq_lens, scale, kv_rank, shape["context"], config=tile)
    expected = mla_decode_reference(queries[0], cache, tables[0], seq_lens.tolist(), scale, kv_rank)
    err = (out.float() - expected.float()).abs().max().item()
    row["max_abs_err"] = err
    row["ok"] = err < (1e-4 if out.dtype == torch.float32 else 3e-2)
    if not row["ok"]:
        print(f"  {key} {name(tile)}: FAILED, max abs error {err:.3g}")
    elif timed:
        from kernel_times import graph_time_us

        calls = [
            lambda q=q, t=t: mla_decode(q, cache, t, seq_lens, scale, kv_rank, shape["context"], config=tile)
            for q, t in zip(queries, tables)
        ]
        row["us"] = graph_time_us(calls)
        row["GBps"] = shape["batch"] * shape["context"] * cache.shape[-1] * cache.element_size() / row["us"] / 1e3
    return row


def config_records(best: str, tiles: list, dtype: str = "bfloat16") -> list[dict]:
    tile = next(t for t in tiles if name(t) == best)
    record = {"dtype": dtype, "kv_lora_rank": KV_RANK, "rope_dim": ROPE, **dataclasses.asdict(tile)}
    return [{**record, "note": "DeepSeek-V2-Lite and V3 latent attention, batch 1-256, 1k-4k contexts"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-only", action="store_true", help="check every tile against the reference, no timing")
    parser.add_argument("--quick", action="store_true", help="about eight tiles instead of the whole sweep")
    add_write_configs_option(parser, "gpuworker/kernels/configs/mla_decode")
    args = parser.parse_args()
    sweep = start_kernel_sweep("mla_decode.py", args.check_only)
    device, timed = sweep.device, sweep.timed
    if args.write_configs and not timed:
        raise SystemExit("--write-configs needs a timed run on a GPU")
    if device == "cuda":
        dtype, kv_rank, rope = torch.bfloat16, KV_RANK, ROPE
        grid = [(b, h, c) for h in HEADS for b in BATCHES for c in CONTEXTS]
    else:
        dtype, kv_rank, rope = torch.float32, TINY["kv_rank"], TINY["rope"]
        grid = [(b, h, c) for h in TINY["heads"] for b in TINY["batches"] for c in TINY["contexts"]]
    from kernel_times import num_sets

    inputs = {}
    for batch, heads, context in grid:
        copies = num_sets(batch * context * (kv_rank + rope) * dtype.itemsize, cap=8) if timed else 1
        inputs[(batch, heads, context)] = make_inputs(batch, heads, context, kv_rank, rope, dtype, device, copies)
    tiles = candidates(args.quick)
    results = []
    for tile in tiles:
        for batch, heads, context in grid:
            shape = {"batch": batch, "heads": heads, "context": context, "kv_rank": kv_rank}
            results.append(measure(tile, shape, inputs, device=device, timed=timed))
        if timed:
            mean = [r["us"] for r in results if r["config"] == name(tile) and "us" in r]
            print(f"  {name(tile)}: {sum(mean) / max(1, len(mean)):.1f} us mean")
    best = pick_tile(results, "us") if timed else None
    if best is not None:
        print(f"best tile: {best}")
    payload = {"timed": timed, "env": sweep.env, "dtype": str(dtype), "best_config": best, "results": results}
    write_json("mla_decode" if timed else "mla_decode_check", payload)
    if args.write_configs and best is not None:
        from gpuworker.kernels.attention.mla_decode import KERNEL, TABLE_KEY

        write_configs(KERNEL, TABLE_KEY, config_records(best, tiles))


if __name__ == "__main__":
    main()
