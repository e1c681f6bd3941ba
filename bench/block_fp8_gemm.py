"""Block-scaled FP8 GEMM sweep (DeepSeek's 128 x 128 weight blocks, activations per token and group of
128) at DeepSeek-V3's dense projections: for each row count, cuBLAS bf16 F.linear on the dequantised
weight and the Triton kernel's candidate tiles, each with the activation quantizer it needs.

    PYTHONPATH=. python bench/block_fp8_gemm.py                 # H100/H200: a few minutes, mostly compiles
    PYTHONPATH=. python bench/block_fp8_gemm.py --check-only    # no timing; on a CPU: tiny shapes, interpreter
    PYTHONPATH=. python bench/block_fp8_gemm.py --write-configs # merge the winners into the GPU's table

Every candidate is checked against block_fp8_matmul_reference first. Times are medians of CUDA-graph
replays (bench/kernel_times.py's graph_time_us) over enough weight copies that the L2 cannot hold
them. Prints, per row count, the sum over one step's projections (weighted by how often a step runs
each), the fastest tile per row bucket, and writes block_fp8_gemm.json to $OUT; with --write-configs
it merges the fastest tile of each row bucket into gpuworker/kernels/configs/block_fp8_matmul/<GPU>.json.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from common import add_write_configs_option, start_kernel_sweep, write_configs, write_json
from gemv import check_config

DTYPE = torch.bfloat16
BLOCK = (128, 128)
# name -> ((N, K), projections of that shape a step runs): DeepSeek-V3's 61 layers (MLA's low-rank
# projections, o_proj, and the dense MLP of the first 3 layers and the shared experts of the other 58).
SHAPES = {
    "q_a_proj": ((1536, 7168), 61),
    "q_b_proj": ((24576, 1536), 61),
    "kv_a_proj": ((576, 7168), 61),
    "kv_b_proj": ((32768, 512), 61),
    "o_proj": ((7168, 16384), 61),
    "dense_gate_up": ((36864, 7168), 3),
    "dense_down": ((7168, 18432), 3),
    "shared_gate_up": ((4096, 7168), 58),
    "shared_down": ((7168, 2048), 58),
}
TINY_SHAPES = {"ragged": ((200, 300), 1), "whole": ((128, 256), 1)}
ROWS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096)
TINY_ROWS = (3, 20)
# (block_m, block_n, num_warps, num_stages, split_k); BLOCK_K is the weight's 128-column group.
# split_k 0 is the automatic split (programs enough to fill the device); split tiles are timed for
# decode row counts only, where few row tiles leave multiprocessors idle.
TILES = (
    (16, 32, 4, 4, 1),
    (16, 64, 4, 3, 1),
    (16, 64, 4, 5, 1),
    (16, 128, 4, 4, 1),
    (16, 64, 4, 3, 0),
    (16, 64, 4, 4, 2),
    (16, 64, 4, 4, 4),
    (16, 64, 4, 4, 8),
    (16, 128, 4, 4, 4),
    (32, 64, 4, 4, 1),
    (32, 128, 4, 3, 1),
    (32, 64, 4, 4, 0),
    (64, 64, 4, 4, 1),
    (64, 128, 4, 3, 1),
    (64, 128, 8, 4, 1),
    (128, 128, 8, 3, 1),
    (128, 256, 8, 3, 1),
)
TINY_TILES = ((16, 32, 4, 1, 1), (32, 16, 4, 1, 1), (16, 32, 4, 1, 2))


def make_block_fp8(n: int, k: int, copies: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random FP8 weights [n, k] with block scales, outputs ~N(0, 1) for unit-variance inputs."""
    rows, cols = BLOCK
    out = []
    for _ in range(copies):
        q = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.full((-(-n // rows), -(-k // cols)), 1 / (64 * k**0.5), device=device)
        out.append((q, scale))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-only", action="store_true", help="check every candidate, no timing (CPU: tiny)")
    add_write_configs_option(parser, "gpuworker/kernels/configs/block_fp8_matmul")
    args = parser.parse_args()
    start = start_kernel_sweep("block_fp8_gemm.py", args.check_only)
    device, timed = start.device, start.timed
    if args.write_configs and not timed:
        parser.error("--write-configs needs a timed sweep on a GPU (not --check-only)")
    from gpuworker.kernels.quant.block_fp8_matmul import (
        GEMM_TABLE_KEY,
        BlockFp8GemmConfig,
        block_fp8_matmul,
        block_fp8_matmul_reference,
        dequantize_block_fp8,
        quantize_fp8_groups,
    )

    on_cuda = device == "cuda"
    shapes, rows_list = (SHAPES, ROWS) if on_cuda else (TINY_SHAPES, TINY_ROWS)
    tiles = [BlockFp8GemmConfig(*t) for t in (TILES if on_cuda else TINY_TILES)]
    torch.manual_seed(0)
    if timed:
        from kernel_times import graph_time_us, num_sets

    results, failures = [], 0
    for name, ((n, k), per_step) in shapes.items():
        copies = num_sets(n * k, cap=8) if timed else 1
        weights = make_block_fp8(n, k, copies, device)
        dense = [dequantize_block_fp8(q, s, *BLOCK).to(DTYPE) for q, s in weights] if timed else []
        for m in rows_list:
            xs = [torch.randn(m, k, device=device).to(DTYPE) for _ in range(copies)]
            x_q, x_scale = quantize_fp8_groups(xs[0], BLOCK[1], use_kernel=True)
            expected = block_fp8_matmul_reference(x_q, x_scale, *weights[0], *BLOCK, out_dtype=DTYPE)
            row = {"shape": name, "N": n, "K": k, "M": m, "per_step": per_step, "tiles": {}}

            def call(i, tile):
                a_q, a_scale = quantize_fp8_groups(xs[i], BLOCK[1], use_kernel=True)
                return block_fp8_matmul(a_q, a_scale, *weights[i], *BLOCK, out_dtype=DTYPE, config=tile)

            for tile in tiles:
                if on_cuda and (tile.block_m > max(16, 2 * m) or (tile.split_k != 1 and m > 64)):
                    continue  # a tile mostly of padding rows, or a split where row tiles are many
                try:
                    err, ok = check_config(lambda tile=tile: call(0, tile), expected, repeats=1)
                    if not ok:
                        raise AssertionError(f"max abs err {err}")
                    if timed:
                        row["tiles"][tile.name] = graph_time_us([lambda i=i, t=tile: call(i, t) for i in range(copies)])
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    failures += 1
                    print(f"  {name} M={m} {tile.name}: FAILED {repr(exc)[:200]}")
            if timed:
                row["cublas_us"] = graph_time_us([lambda i=i: F.linear(xs[i], dense[i]) for i in range(copies)])
            results.append(row)
            print(f"  {name} M={m}: {len(row['tiles']) if timed else len(tiles)} tiles")
        weights = dense = None
        if on_cuda:
            torch.cuda.empty_cache()

    write_json("block_fp8_gemm" if timed else "block_fp8_gemm_check", {"environment": start.env, "results": results})
    if timed:
        tiles_by_name = {tile.name: tile for tile in tiles}
        tuned = print_summary(results, rows_list, tiles_by_name)
        if args.write_configs:
            write_configs("block_fp8_matmul", GEMM_TABLE_KEY, config_records(tuned, tiles_by_name))
    if failures:
        raise SystemExit(f"{failures} block FP8 GEMM result(s) disagreed with the reference or failed to run")


def print_summary(results: list[dict], rows_list, tiles_by_name: dict) -> dict[int, str]:
    """Print the per-step totals against cuBLAS bf16; return {rows: fastest tile summed over the shapes}."""
    print("\n== block FP8 GEMM per step (DeepSeek-V3 dense projections), ms ==")
    print(f"{'M':>6s} {'cuBLAS bf16':>11s} {'best Triton':>11s}  best tile")
    tuned = {}
    for m in rows_list:
        rows = [r for r in results if r["M"] == m]
        cublas = sum(r["cublas_us"] * r["per_step"] for r in rows) / 1e3
        names = set.intersection(*(set(r["tiles"]) for r in rows))
        totals = {t: sum(r["tiles"][t] * r["per_step"] for r in rows) / 1e3 for t in names}
        best = min(totals, key=totals.get)
        tuned[m] = best
        print(f"{m:6d} {cublas:11.3f} {totals[best]:11.3f}  {tiles_by_name[best]!r}")
    return tuned


def config_records(tuned: dict[int, str], tiles_by_name: dict) -> list[dict]:
    """Records for gpuworker/kernels/configs/block_fp8_matmul: the fastest tile of each row bucket."""
    return [
        {
            "rows": m,
            **dataclasses.asdict(tiles_by_name[name]),
            "note": "deepseek-v3 dense projections, the fastest tile summed over the shapes",
        }
        for m, name in sorted(tuned.items())
    ]


if __name__ == "__main__":
    main()
