"""Quantized batch-1 GEMV sweep: the INT4 GEMV (AWQ/GPTQ layout, group 128) and the FP8-weight GEMV at
Llama-3-8B's decode projections, one row, bf16 activations, on one GPU, against cuBLAS bf16 F.linear
and the config each kernel picks today.

    PYTHONPATH=. python bench/quant_gemv.py                # H200: about two minutes, mostly Triton compiles
    PYTHONPATH=. python bench/quant_gemv.py --only int4    # or fp8
    PYTHONPATH=. python bench/quant_gemv.py --check-only   # no timing; on a CPU: tiny shapes, interpreter

Every candidate is checked against the kernel's torch reference (int4_matmul_reference,
fp8_matmul_reference) before it is timed; one that disagrees or fails to compile is reported and
skipped. Times are medians of CUDA-graph replays over enough weight copies that the L2 cannot hold
them (bench/kernel_times.py's graph_time_us), so launch overhead is out. GB/s counts the bytes the kernel
must move (packed weight, zero points and scales, or the FP8 weight and its row scales, plus x and
the output); cuBLAS's counts its bf16 weight. Prints the fastest config per shape and writes
quant_gemv.json to $OUT (or bench/results/); with --write-configs it merges them into
gpuworker/kernels/configs/int4_gemv/<this GPU>.json and the FP8 records of configs/gemv/<this GPU>.json.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import torch.nn.functional as F

from common import add_write_configs_option, start_kernel_sweep, write_configs, write_json
from gemv import check_config

DTYPE = torch.bfloat16
GROUP = 128
# (N, K) and how many times one decode step runs each (32 layers).
SHAPES = {
    "qkv": ((6144, 4096), 32),
    "o_proj": ((4096, 4096), 32),
    "gate_up": ((28672, 4096), 32),
    "down": ((4096, 14336), 32),
}
# Interpreter shapes for --check-only on a CPU: a column tail, a group count no step size divides,
# and enough groups for split-K; the group size drops to 32 so the shapes stay small.
TINY_SHAPES = {"ragged": ((70, 352), 1), "deep": ((48, 1024), 1)}
TINY_GROUP = 32
# INT4 tiles (block_n, block_k, num_warps, num_stages); each is one Triton compile shared by every
# shape and split count. The first is the tiling of the kernel before split-K (32 columns, one group
# a step, no split), kept as the baseline.
INT4_TILES = (
    (32, 128, 4, 4),
    (16, 256, 2, 3),
    (16, 512, 4, 3),
    (32, 256, 4, 3),
    (32, 512, 4, 2),
    (64, 128, 4, 3),
    (64, 256, 4, 1),
    (64, 256, 4, 3),
    (64, 256, 8, 3),
    (64, 512, 4, 2),
    (64, 512, 8, 3),
    (128, 128, 4, 3),
    (128, 256, 4, 2),
    (128, 256, 8, 3),
    (128, 512, 8, 2),
    (256, 128, 8, 3),
)
# Split-K counts tried per tile: those giving 2 to 8 programs per SM of an H200 (132 SMs), and no split
# where the column blocks alone give every SM one (split-K's reduction costs a round trip to L2).
NUM_SMS = 132
MIN_PROGRAMS, MAX_PROGRAMS = 2 * NUM_SMS, 8 * NUM_SMS


def int4_candidates(n: int, k: int, group: int, *, on_cuda: bool):
    """Every INT4 tile with the split counts that fill the GPU (on a CPU: 1 and 3, for the check), the
    baseline tile unsplit, and the config the kernel picks today; each also with x read as words."""
    from gpuworker.kernels.quant.int4_matmul import Int4GemvConfig, pick_gemv_config

    configs = [pick_gemv_config(n, k, group)]
    for i, (block_n, block_k, num_warps, num_stages) in enumerate(INT4_TILES):
        tile = Int4GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
        steps = -(-k // max(block_k, group))
        blocks = -(-n // block_n)
        if i == 0:
            splits = [1]
        elif not on_cuda:
            splits = [1, 3]
        else:
            splits = [
                s
                for s in (1, 2, 4, 8, 16, 32)
                if s <= steps and (MIN_PROGRAMS <= blocks * s <= MAX_PROGRAMS or (s == 1 and blocks >= NUM_SMS))
            ]
            splits = splits or [min((1, 2, 4, 8, 16, 32), key=lambda s: abs(blocks * s - MIN_PROGRAMS))]
        configs += [replace(tile, split_k=s) for s in splits]
    # Each with bfloat16 x read as 32-bit words too (half the loads of x, no conversions).
    configs += [replace(c, x_words=True) for c in configs]
    unique = {c.name: c for c in configs}
    return list(unique.values())


def fp8_candidates(n: int, k: int):
    """gemv's FP8 candidates, the bf16 one-row FMA candidates, and the config gemv picks today."""
    from gpuworker.kernels.linear.gemv import CANDIDATES, FP8_CANDIDATES, pick_config

    configs = [pick_config(1, n, k, fp8_weight=True), *FP8_CANDIDATES, *(c for c in CANDIDATES if not c.use_dot)]
    return list({c.name: c for c in configs}.values())


def make_int4(n: int, k: int, group: int, copies: int, device: str):
    """Random packed weights whose products with a unit-variance row are ~N(0, 1)."""
    info = torch.iinfo(torch.int32)
    sets = []
    for _ in range(copies):
        qweight = torch.randint(info.min, info.max, (k // 8, n), dtype=torch.int32, device=device)
        zeros = torch.randint(0, 17, (k // group, n), dtype=torch.uint8, device=device)
        # q - zero has a standard deviation of about 5.
        scales = ((0.5 + torch.rand(k // group, n, device=device)) / (5 * k**0.5)).half()
        sets.append((qweight, zeros, scales))
    return sets


def make_fp8(n: int, k: int, copies: int, device: str):
    from gpuworker.kernels.quant.fp8_matmul import quantize_fp8_rows

    return [quantize_fp8_rows(torch.randn(n, k, device=device) / k**0.5) for _ in range(copies)]


def sweep_shape(kind: str, name: str, n: int, k: int, group: int, *, device: str, timed: bool) -> tuple[dict, list]:
    """One shape for one kernel: check then time every candidate; cuBLAS bf16 alongside."""
    from gpuworker.kernels.linear.gemv import gemv, pick_config
    from gpuworker.kernels.quant.fp8_matmul import fp8_matmul_reference
    from gpuworker.kernels.quant.int4_matmul import Int4GemvConfig, int4_matmul, int4_matmul_reference, pick_gemv_config

    copies = 1
    if timed:
        from kernel_times import graph_time_us, num_sets

        copies = num_sets(n * k // (2 if kind == "int4" else 1), cap=16)
    xs = [torch.randn(1, k, device=device).to(DTYPE) for _ in range(copies)]
    if kind == "int4":
        weights = make_int4(n, k, group, copies, device)
        moved = n * k // 2 + 3 * n * (k // group) + 2 * k + 2 * n
        expected = int4_matmul_reference(xs[0], *weights[0], group)
        candidates = int4_candidates(n, k, group, on_cuda=device == "cuda")
        picked = pick_gemv_config(n, k, group).name
        before = Int4GemvConfig(*INT4_TILES[0]).name  # the tiling before split-K

        def call(config, i):
            return int4_matmul(xs[i], *weights[i], group, gemv_config=config)
    else:
        weights = make_fp8(n, k, copies, device)
        moved = n * k + 4 * n + 2 * k + 2 * n
        expected = fp8_matmul_reference(xs[0], *weights[0], out_dtype=DTYPE)
        candidates = fp8_candidates(n, k)
        picked = before = pick_config(1, n, k, fp8_weight=True).name

        def call(config, i):
            return gemv(xs[i], weights[i][0], config=config, weight_scale=weights[i][1])

    row = {
        "kernel": kind,
        "shape": name,
        "N": n,
        "K": k,
        "group": group if kind == "int4" else None,
        "bytes": moved,
        "copies": copies,
        "picked_config": picked,
        "before_config": before,
    }
    if timed:
        cublas_copies = num_sets(n * k * 2, cap=16)
        dense = [(torch.randn(n, k, device=device) / k**0.5).to(DTYPE) for _ in range(cublas_copies)]
        row["cublas_us"] = graph_time_us([lambda i=i: F.linear(xs[i % copies], dense[i]) for i in range(cublas_copies)])
        row["cublas_GBps"] = (2 * n * k + 4 * k + 2 * n) / row["cublas_us"] / 1e3
        del dense
    sweep, timings = [], {}
    for config in candidates:
        entry = {"kernel": kind, "shape": name, "config": config.name}
        try:
            # Split-K's cross-program reduction is checked more than once on a GPU, once in the interpreter.
            err, ok = check_config(lambda: call(config, 0), expected, repeats=3 if timed else 1)
            entry.update(max_abs_err=err, ok=ok)
            if ok and timed:
                us = graph_time_us([lambda i=i: call(config, i) for i in range(copies)])
                entry.update(us=us, GBps=moved / us / 1e3)
                timings[config.name] = (us, config)
        except Exception as exc:  # noqa: BLE001 - a config that cannot compile/run is reported, not fatal
            entry.update(ok=False, error=repr(exc)[:300])
        if not entry.get("ok"):
            print(f"  {kind} {name} {config.name}: FAILED {entry.get('error') or entry.get('max_abs_err')}")
        sweep.append(entry)
    row["max_abs_err"] = max((e.get("max_abs_err", 0.0) for e in sweep), default=0.0)
    row["all_ok"] = all(e.get("ok") for e in sweep)
    if timings:
        best = min(timings, key=lambda name_: timings[name_][0])
        row.update(
            best_config=best,
            best_us=timings[best][0],
            best_GBps=moved / timings[best][0] / 1e3,
            best=timings[best][1],
            picked_us=timings.get(picked, (None,))[0],
            before_us=timings.get(before, (None,))[0],
        )
    # Rebound to None rather than deleted: ruff reads a name deleted after a lambda or closure that
    # uses it as undefined there (F821); the memory goes back all the same.
    weights = None
    if device == "cuda":
        torch.cuda.empty_cache()
    return row, sweep


def print_results(rows: list[dict], copy_gbps: float | None) -> None:
    if not copy_gbps:
        print("\n== quantized GEMV check ==")
        for r in rows:
            status = "ok" if r["all_ok"] else "MISMATCH"
            print(
                f"{r['kernel']:4s} {r['shape']:8s} N={r['N']:<6d} K={r['K']:<6d} max abs err {r['max_abs_err']:.4g}"
                f"  {status}"
            )
        return
    print(f"\n== quantized GEMV, M=1, bf16 activations (copy bandwidth {copy_gbps:.0f} GB/s) ==")
    print(
        "(before: INT4, the tiling before split-K, n32-k128 unsplit, with the current unpacking; FP8, the\n"
        " bf16 table's config. picked: what the kernel takes now, from this GPU's tables.)"
    )
    print(
        f"{'kernel':6s} {'shape':8s} {'N':>6s} {'K':>6s} {'cuBLAS bf16 us':>14s} {'before us':>9s} {'picked us':>9s} "
        f"{'%copy':>5s} {'best config':30s} {'us':>7s} {'GB/s':>6s} {'%copy':>5s} {'vs cuBLAS':>9s}"
    )
    for r in rows:
        if "best_us" not in r:
            print(f"{r['kernel']:6s} {r['shape']:8s} {r['N']:6d} {r['K']:6d} {r['cublas_us']:14.1f}  no config passed")
            continue
        picked = r.get("picked_us")
        picked_text = (
            f"{picked:9.1f} {100 * r['bytes'] / picked / 1e3 / copy_gbps:4.0f}%" if picked else f"{'-':>9s} {'-':>5s}"
        )
        before = f"{r['before_us']:9.1f}" if r.get("before_us") else f"{'-':>9s}"
        print(
            f"{r['kernel']:6s} {r['shape']:8s} {r['N']:6d} {r['K']:6d} {r['cublas_us']:14.1f} {before} {picked_text} "
            f"{r['best_config']:30s} {r['best_us']:7.1f} {r['best_GBps']:6.0f} "
            f"{100 * r['best_GBps'] / copy_gbps:4.0f}% {r['cublas_us'] / r['best_us']:8.2f}x"
        )


def step_estimate(rows: list[dict]) -> dict:
    """The linear layers of one decode step (32 layers, lm_head left out) per kernel: picked and best."""
    estimate = {}
    for kind in sorted({r["kernel"] for r in rows}):
        mine = [r for r in rows if r["kernel"] == kind and "best_us" in r]
        count = {name: SHAPES[name][1] for name in SHAPES}
        estimate[kind] = {
            "cublas_bf16_ms": sum(count[r["shape"]] * r["cublas_us"] for r in mine) / 1e3,
            "picked_ms": sum(count[r["shape"]] * (r["picked_us"] or r["best_us"]) for r in mine) / 1e3,
            "best_ms": sum(count[r["shape"]] * r["best_us"] for r in mine) / 1e3,
        }
    return estimate


def print_tables(rows: list[dict]) -> None:
    for kind, title in (("int4", "INT4 GEMV (int4_matmul, one row)"), ("fp8", "FP8-weight gemv (one row)")):
        best = [r for r in rows if r["kernel"] == kind and "best" in r]
        if best:
            print(f"\nfastest {title} per shape:")
        for r in best:
            print(
                f"    {r['shape']:8s} N={r['N']:<6d} K={r['K']:<6d} {r['best_config']:30s} "
                f"{r['best_us']:.1f} us, {r['best_GBps']:.0f} GB/s"
            )


def config_records(rows: list[dict]) -> dict[str, list[dict]]:
    """The records --write-configs merges, per configs/ kernel: int4_gemv (each INT4 shape's fastest
    config) and gemv (each FP8 shape's, as an FP8 weight's record; FP8 linears take gemv at one row)."""
    import dataclasses

    records: dict[str, list[dict]] = {"int4_gemv": [], "gemv": []}
    for r in rows:
        if "best" not in r:
            continue
        note = f"llama-3-8b {r['shape']}"
        if r["kernel"] == "int4":
            records["int4_gemv"].append(
                {"n": r["N"], "k": r["K"], "group_size": r["group"], **dataclasses.asdict(r["best"]), "note": note}
            )
        else:
            records["gemv"].append(
                {
                    "weight_dtype": "float8_e4m3fn",
                    "n": r["N"],
                    "k": r["K"],
                    "m": 1,
                    "config": r["best_config"],
                    "note": note,
                }
            )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="check every candidate against its reference without timing (tiny shapes on a CPU)",
    )
    parser.add_argument("--only", choices=("int4", "fp8"), help="sweep one kernel")
    add_write_configs_option(parser, "gpuworker/kernels/configs/int4_gemv and configs/gemv (FP8 weights)")
    args = parser.parse_args()
    start = start_kernel_sweep("quant_gemv.py", args.check_only)
    device, timed, env, copy_gbps = start.device, start.timed, start.env, start.copy_gbps
    if args.write_configs and not timed:
        parser.error("--write-configs needs a timed sweep on a GPU (not --check-only)")
    on_cuda = device == "cuda"
    torch.manual_seed(0)
    shapes = SHAPES if on_cuda else TINY_SHAPES
    group = GROUP if on_cuda else TINY_GROUP
    kinds = (args.only,) if args.only else ("int4", "fp8")

    rows, sweep = [], []
    for kind in kinds:
        for name, ((n, k), _) in shapes.items():
            row, shape_sweep = sweep_shape(kind, name, n, k, group, device=device, timed=timed)
            rows.append(row)
            sweep += shape_sweep
            print(f"  {kind} {name} ({n}x{k}) done: {len(shape_sweep)} configs")

    payload = {
        "environment": env,
        "copy_bandwidth_GBps": copy_gbps,
        "timed": timed,
        "results": [{key: value for key, value in r.items() if key != "best"} for r in rows],
        "sweep": sweep,
    }
    if timed:
        payload["step_estimate"] = step_estimate(rows)
    write_json("quant_gemv" if timed else "quant_gemv_check", payload)
    print_results(rows, copy_gbps)
    if timed:
        print("\nlinear layers per decode step (32 layers, lm_head left out):")
        for kind, e in payload["step_estimate"].items():
            print(
                f"  {kind}: cuBLAS bf16 {e['cublas_bf16_ms']:.3f} ms, picked {e['picked_ms']:.3f} ms, "
                f"best {e['best_ms']:.3f} ms"
            )
        print_tables(rows)
        if args.write_configs:
            from gpuworker.kernels.linear.gemv import TABLE_KEY
            from gpuworker.kernels.quant.int4_matmul import GEMV_TABLE_KEY

            records = config_records(rows)
            for kernel, key in (("int4_gemv", GEMV_TABLE_KEY), ("gemv", TABLE_KEY)):
                if records[kernel]:
                    write_configs(kernel, key, records[kernel])
    failed = [e for e in sweep if not e.get("ok")]
    if failed:
        raise SystemExit(f"{len(failed)} quantized GEMV result(s) disagreed with the reference or failed to run")


if __name__ == "__main__":
    main()
