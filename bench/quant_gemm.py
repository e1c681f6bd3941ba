"""Batched INT4 (AWQ/GPTQ layout, group 128) GEMM sweep at Llama-3-8B's projections: for each row count,
cuBLAS bf16 F.linear, the dequantise-then-torch.mm path, and the Triton kernel's candidate tiles.

    PYTHONPATH=. python bench/quant_gemm.py                # H200: a few minutes, mostly Triton compiles
    PYTHONPATH=. python bench/quant_gemm.py --check-only   # no timing; on a CPU: tiny shapes, interpreter

Every candidate is checked against int4_matmul_reference first. Times are medians of CUDA-graph replays
(bench/kernel_times.py's graph_time_us) over enough weight copies that the L2 cannot hold them. Prints, per row
count, the sum over one decode step's 32 layers of the four projections, the fastest tile per row bucket
and the DEQUANT_MIN_ROWS crossover of gpuworker/kernels/quant/int4_matmul.py, and writes quant_gemm.json to
$OUT; with --write-configs it merges the tiles below the crossover into
gpuworker/kernels/configs/int4_matmul/<this GPU>.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import add_write_configs_option, start_kernel_sweep, write_configs, write_json
from gemv import check_config
from quant_gemv import GROUP, SHAPES, TINY_GROUP, TINY_SHAPES, make_int4

DTYPE = torch.bfloat16
ROWS = (16, 32, 64, 128, 256, 512, 1024, 8192)
TINY_ROWS = (3, 20)
# (block_m, block_n, block_k, num_warps, num_stages). Tiles computed transposed (W x^T, the
# dequantised weight as wgmma's left operand) won none of 32 shapes and row counts on the H200
# (BENCHMARKS.md) and are gone.
TILES = (
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (32, 128, 128, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 3),
)
TINY_TILES = ((16, 32, 32, 4, 1), (32, 16, 16, 4, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-only", action="store_true", help="check every candidate, no timing (CPU: tiny)")
    add_write_configs_option(parser, "gpuworker/kernels/configs/int4_matmul")
    args = parser.parse_args()
    start = start_kernel_sweep("quant_gemm.py", args.check_only)
    device, timed = start.device, start.timed
    if args.write_configs and not timed:
        parser.error("--write-configs needs a timed sweep on a GPU (not --check-only)")
    from gpuworker.kernels.quant.int4_matmul import (
        Int4GemmConfig,
        dequantize_int4_to,
        int4_matmul,
        int4_matmul_reference,
    )

    on_cuda = device == "cuda"
    shapes, group = (SHAPES, GROUP) if on_cuda else (TINY_SHAPES, TINY_GROUP)
    rows_list = ROWS if on_cuda else TINY_ROWS
    tiles = [Int4GemmConfig(*t) for t in (TILES if on_cuda else TINY_TILES)]
    torch.manual_seed(0)
    if timed:
        from kernel_times import graph_time_us, num_sets

    results, failures = [], 0
    for name, ((n, k), per_step) in shapes.items():
        copies = num_sets(n * k // 2, cap=8) if timed else 1
        weights = make_int4(n, k, group, copies, device)
        dense = (
            [(torch.randn(n, k, device=device) / k**0.5).to(DTYPE) for _ in range(num_sets(n * k * 2, cap=8))]
            if timed
            else []
        )
        for m in rows_list:
            xs = [torch.randn(m, k, device=device).to(DTYPE) for _ in range(copies)]
            expected = int4_matmul_reference(xs[0], *weights[0], group)
            row = {"shape": name, "N": n, "K": k, "M": m, "per_step": per_step, "tiles": {}}
            paths = {"dequant": lambda i: torch.mm(xs[i], dequantize_int4_to(*weights[i], group, DTYPE))}
            for tile in tiles:
                if tile.block_k <= group and (tile.block_m <= max(16, m) or not on_cuda):
                    paths[tile.name] = lambda i, tile=tile: int4_matmul(xs[i], *weights[i], group, gemm_config=tile)
            for label, call in paths.items():
                try:
                    err, ok = check_config(lambda: call(0), expected, repeats=1)
                    if not ok:
                        raise AssertionError(f"max abs err {err}")
                    if timed:
                        row["tiles"][label] = graph_time_us([lambda i=i: call(i) for i in range(copies)])
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    failures += 1
                    print(f"  {name} M={m} {label}: FAILED {repr(exc)[:200]}")
            if timed:
                row["cublas_us"] = graph_time_us(
                    [lambda i=i: F.linear(xs[i % copies], dense[i]) for i in range(len(dense))]
                )
            results.append(row)
            print(f"  {name} M={m}: {len(paths)} paths")
        # Rebound to None rather than deleted: ruff reads a name deleted after a lambda or closure that
        # uses it as undefined there (F821); the memory goes back all the same.
        weights = dense = None
        if on_cuda:
            torch.cuda.empty_cache()

    write_json("quant_gemm" if timed else "quant_gemm_check", {"environment": start.env, "results": results})
    if timed:
        tiles_by_name = {tile.name: tile for tile in tiles}
        tuned, dequant_from = print_summary(results, rows_list, tiles_by_name)
        if args.write_configs:
            from gpuworker.kernels.quant.int4_matmul import GEMM_TABLE_KEY

            write_configs("int4_matmul", GEMM_TABLE_KEY, *config_records(tuned, dequant_from, tiles_by_name))
    if failures:
        raise SystemExit(f"{failures} INT4 GEMM result(s) disagreed with the reference or failed to run")


def print_summary(results: list[dict], rows_list, tiles_by_name: dict) -> tuple[dict[int, str], int | None]:
    """Print the per-step totals; return ({rows: fastest tile}, the row count from which dequantise-then-mm
    wins at every larger count, None if it does not)."""
    print("\n== INT4 GEMM per decode step (32 layers x qkv, o_proj, gate_up, down), ms ==")
    print(f"{'M':>6s} {'cuBLAS bf16':>11s} {'dequant+mm':>10s} {'best Triton':>11s}  best tile")
    tuned, dequant_from = {}, None
    for m in rows_list:
        rows = [r for r in results if r["M"] == m]
        cublas = sum(r["cublas_us"] * r["per_step"] for r in rows) / 1e3
        dequant = sum(r["tiles"]["dequant"] * r["per_step"] for r in rows) / 1e3
        names = set.intersection(*({t for t in r["tiles"] if t != "dequant"} for r in rows))
        totals = {t: sum(r["tiles"][t] * r["per_step"] for r in rows) / 1e3 for t in names}
        best = min(totals, key=totals.get)
        tuned[m] = best
        print(f"{m:6d} {cublas:11.3f} {dequant:10.3f} {totals[best]:11.3f}  {best}")
        if dequant < totals[best]:
            dequant_from = dequant_from or m
        else:
            dequant_from = None
    print("\nfastest tile per row bucket, summed over the shapes, below the crossover:")
    for m, name in tuned.items():
        if dequant_from is not None and m >= dequant_from and m != min(tuned):
            break
        print(f"    {m}: {tiles_by_name[name]!r}")
    print(f"crossover (DEQUANT_MIN_ROWS) = {dequant_from or 1 << 30}")
    return tuned, dequant_from


def config_records(
    tuned: dict[int, str], dequant_from: int | None, tiles_by_name: dict
) -> tuple[list[dict], list[dict]]:
    """(records, removals) for gpuworker/kernels/configs/int4_matmul: the fastest tile of each row
    bucket below the crossover, and always of the smallest bucket, which serves every row count below
    it; the other buckets' records taken out."""
    import dataclasses

    records, removals = [], []
    for m, name in sorted(tuned.items()):
        if dequant_from is None or m < dequant_from or m == min(tuned):
            records.append(
                {
                    "rows": m,
                    **dataclasses.asdict(tiles_by_name[name]),
                    "note": "llama-3-8b projections, the fastest tile summed over the shapes",
                }
            )
        else:
            removals.append({"rows": m})
    return records, removals


if __name__ == "__main__":
    main()
