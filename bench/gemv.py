"""GEMV benchmark: cuBLAS (F.linear) against gpuworker.kernels.linear.gemv's candidate configs at one model's
decode projections (Llama-3-8B's, or --shapes qwen3-30b-a3b), M = 1, 2, 4, 8 rows, bf16, on one GPU.

    PYTHONPATH=. python bench/gemv.py [--quick]        # H200: about a minute, mostly Triton compiles
    PYTHONPATH=. python bench/gemv.py --quick --shapes qwen3-30b-a3b
    PYTHONPATH=. python bench/gemv.py --check-only     # no timing; on a CPU: tiny shapes, interpreter
    PYTHONPATH=. python bench/gemv.py --layer-chain    # 32 layers' decode-row projections in one graph

Every result is checked against F.linear (max abs error) before it is timed; a config that disagrees
is reported and skipped. Times are medians of CUDA-graph replays over enough weight copies that the
L2 cannot hold them (as 32 layers do in a real step), so launch overhead is out. GB/s counts the
weight plus activations read and the output written. Also times the down projection fed by
silu_and_mul (the activation kernel then cuBLAS) against the fused gemv, for models with a dense MLP.
Prints the one-row winners that beat cuBLAS and writes gemv.json to $OUT (or bench/results/); with
--write-configs it merges them into gpuworker/kernels/configs/gemv/<this GPU>.json (and takes out the
records of shapes where cuBLAS won), which the model layers' choice of gemv or cuBLAS follows.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from common import add_write_configs_option, start_kernel_sweep, write_configs, write_json

DTYPE = torch.bfloat16
ES = 2
# Per model, each decode projection's (N, K) and how many times one decode step runs it.
SHAPE_SETS = {
    "llama-3-8b": {
        "qkv": ((6144, 4096), 32),
        "o_proj": ((4096, 4096), 32),
        "gate_up": ((28672, 4096), 32),
        "down": ((4096, 14336), 32),
        "lm_head": ((128256, 4096), 1),
    },
    # Qwen3-30B-A3B: 32 query heads and 4 kv heads of 128 over a hidden size of 2048, 128 experts
    # (the router); the experts themselves run in kernels.moe_decode (bench/moe_decode.py).
    "qwen3-30b-a3b": {
        "qkv": ((5120, 2048), 48),
        "o_proj": ((2048, 4096), 48),
        "router": ((128, 2048), 48),
        "lm_head": ((151936, 2048), 1),
    },
}
SHAPES = SHAPE_SETS["llama-3-8b"]
ROWS = (1, 2, 4, 8)
# Interpreter shapes for --check-only on a CPU: ragged N and K, and a K deep enough for split-K.
TINY_SHAPES = {"ragged": ((70, 200), 1), "deep": ((48, 1100), 1)}
# The row counts whose winners --write-configs records: the model layers take gemv for one decode row
# (at more rows the winners were within noise of cuBLAS and need split-K counters under CUDA graphs).
WRITTEN_ROWS = (1,)


def max_error(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, bool]:
    err = (got.float() - expected.float()).abs().max().item()
    # A few bf16 steps of the largest output: rounding and summation order, not a wrong answer.
    return err, err <= 0.02 * max(1.0, expected.float().abs().max().item())


def check_config(call, expected: torch.Tensor, repeats: int = 3) -> tuple[float, bool]:
    """Worst error over a few runs (split-K's cross-program reduction is checked more than once)."""
    worst, all_ok = 0.0, True
    for _ in range(repeats):
        err, ok = max_error(call(), expected)
        worst, all_ok = max(worst, err), all_ok and ok
    return worst, all_ok


def make_weights(n: int, k: int, copies: int, device: str) -> list[torch.Tensor]:
    # Scaled so outputs are ~N(0, 1) for unit-variance inputs.
    return [(torch.randn(n, k, device=device) / k**0.5).to(DTYPE) for _ in range(copies)]


def run_shape(name: str, n: int, k: int, rows, configs, *, device: str, timed: bool) -> tuple[list, list]:
    from gpuworker.kernels.linear.gemv import gemv, pick_config

    results, sweep = [], []
    copies = 1
    if timed:
        from kernel_times import graph_time_us, num_sets

        copies = num_sets(n * k * ES, cap=16)
    weights = make_weights(n, k, copies, device)
    for m in rows:
        xs = [torch.randn(m, k, device=device).to(DTYPE) for _ in range(copies)]
        expected = F.linear(xs[0], weights[0])
        moved = (n * k + m * k + m * n) * ES
        row = {"shape": name, "N": n, "K": k, "M": m, "bytes": moved, "copies": copies}
        if timed:
            row["cublas_us"] = graph_time_us([lambda i=i: F.linear(xs[i], weights[i]) for i in range(copies)])
            row["cublas_GBps"] = moved / row["cublas_us"] / 1e3
        timings = {}
        for config in configs:
            entry = {"shape": name, "M": m, "config": config.name}
            try:
                err, ok = check_config(lambda: gemv(xs[0], weights[0], config=config), expected)
                entry.update(max_abs_err=err, ok=ok)
                if ok and timed:
                    us = graph_time_us([lambda i=i: gemv(xs[i], weights[i], config=config) for i in range(copies)])
                    entry.update(us=us, GBps=moved / us / 1e3)
                    timings[config.name] = us
            except Exception as exc:  # noqa: BLE001 - a config that cannot compile/run is reported, not fatal
                entry.update(ok=False, error=repr(exc)[:300])
            if not entry.get("ok"):
                print(f"  {name} M={m} {config.name}: FAILED {entry.get('error') or entry.get('max_abs_err')}")
            sweep.append(entry)
        row["max_abs_err"] = max(
            (e.get("max_abs_err", 0.0) for e in sweep if e["shape"] == name and e["M"] == m), default=0.0
        )
        row["all_ok"] = all(e.get("ok") for e in sweep if e["shape"] == name and e["M"] == m)
        if timings:
            best = min(timings, key=timings.get)
            default = pick_config(m, n, k).name
            row.update(
                best_config=best,
                best_us=timings[best],
                best_GBps=moved / timings[best] / 1e3,
                speedup=row["cublas_us"] / timings[best],
                default_config=default,
                default_us=timings.get(default),
            )
        results.append(row)
    # Rebound to None rather than deleted: ruff reads a name deleted after a lambda or closure that
    # uses it as undefined there (F821); the memory goes back all the same.
    weights = None
    if device == "cuda":
        torch.cuda.empty_cache()
    return results, sweep


def run_fused_down(n: int, k: int, rows, best_by_m: dict[int, str], *, device: str, timed: bool) -> list[dict]:
    """down(silu_and_mul(gate_up)): activation kernel + cuBLAS against gemv(silu_mul_input=True)."""
    from gpuworker.kernels.linear.activation import silu_and_mul
    from gpuworker.kernels.linear.gemv import CANDIDATES_BY_NAME, gemv, pick_config

    copies = 1
    if timed:
        from kernel_times import graph_time_us, num_sets

        copies = num_sets(n * k * ES, cap=16)
    weights = make_weights(n, k, copies, device)
    out = []
    for m in rows:
        gate_up = [3 * torch.randn(m, 2 * k, device=device).to(DTYPE) for _ in range(copies)]
        config = CANDIDATES_BY_NAME.get(best_by_m.get(m, ""), pick_config(m, n, k))
        expected = F.linear(silu_and_mul(gate_up[0]), weights[0])
        moved = (n * k + 2 * m * k + m * n) * ES
        row = {"shape": "down(silu_and_mul)", "N": n, "K": k, "M": m, "config": config.name, "bytes": moved}
        err, ok = check_config(lambda: gemv(gate_up[0], weights[0], silu_mul_input=True, config=config), expected)
        row.update(max_abs_err=err, ok=ok)
        if timed:
            row["unfused_us"] = graph_time_us(
                [lambda i=i: F.linear(silu_and_mul(gate_up[i]), weights[i]) for i in range(copies)]
            )
            if ok:
                row["fused_us"] = graph_time_us(
                    [
                        lambda i=i: gemv(gate_up[i], weights[i], silu_mul_input=True, config=config)
                        for i in range(copies)
                    ]
                )
                row["speedup"] = row["unfused_us"] / row["fused_us"]
        out.append(row)
    weights = None
    return out


def print_results(results: list[dict], fused: list[dict], copy_gbps: float | None) -> None:
    print(f"\n== GEMV, bf16 (copy bandwidth {copy_gbps:.0f} GB/s) ==" if copy_gbps else "\n== GEMV check ==")
    if copy_gbps:
        print(
            f"{'shape':9s} {'N':>6s} {'K':>6s} {'M':>2s} {'cuBLAS us':>9s} {'GB/s':>6s} {'best triton':28s} "
            f"{'us':>7s} {'GB/s':>6s} {'%copy':>5s} {'speedup':>7s} {'default us':>10s}"
        )
        for r in results:
            if "best_us" not in r:
                print(
                    f"{r['shape']:9s} {r['N']:6d} {r['K']:6d} {r['M']:2d} {r['cublas_us']:9.1f} "
                    f"{r['cublas_GBps']:6.0f}  no Triton config passed the check"
                )
                continue
            default = f"{r['default_us']:10.1f}" if r.get("default_us") else f"{'-':>10s}"
            print(
                f"{r['shape']:9s} {r['N']:6d} {r['K']:6d} {r['M']:2d} {r['cublas_us']:9.1f} {r['cublas_GBps']:6.0f} "
                f"{r['best_config']:28s} {r['best_us']:7.1f} {r['best_GBps']:6.0f} "
                f"{100 * r['best_GBps'] / copy_gbps:4.0f}% {r['speedup']:6.2f}x {default}"
            )
        if fused:
            print(f"\n{'fused down':20s} {'M':>2s} {'silu+cuBLAS us':>14s} {'fused us':>9s} {'speedup':>7s}  config")
        for r in fused:
            fused_us = f"{r['fused_us']:9.1f} {r['speedup']:6.2f}x" if "fused_us" in r else f"{'FAILED':>9s} {'-':>7s}"
            print(f"{r['shape']:20s} {r['M']:2d} {r['unfused_us']:14.1f} {fused_us}  {r['config']}")
    else:
        for r in results + fused:
            status = "ok" if r.get("all_ok", r.get("ok")) else "MISMATCH"
            print(
                f"{r['shape']:20s} N={r['N']:<6d} K={r['K']:<6d} M={r['M']:<2d} max abs err {r['max_abs_err']:.4g}"
                f"  {status}"
            )


def step_estimate(results: list[dict], shapes: dict) -> dict:
    """Linear-layer time of one decode step per M (the projections of `shapes`): all cuBLAS, and the
    faster of the two per shape."""
    estimate = {}
    for m in sorted({r["M"] for r in results}):
        cublas = best = 0.0
        for r in (r for r in results if r["M"] == m):
            count = shapes[r["shape"]][1]
            cublas += count * r["cublas_us"]
            best += count * min(r["cublas_us"], r.get("best_us", r["cublas_us"]))
        estimate[m] = {"cublas_ms": cublas / 1e3, "best_of_both_ms": best / 1e3}
    return estimate


def layer_chain(copy_gbps: float, layers: int = 32) -> list[dict]:
    """The decode-row projections of `layers` Llama-3-8B layers as the model runs them at batch 1
    (pre-norm fused into qkv and gate_up, o_proj, down with SiLU-and-mul fused; attention left out),
    each layer its own weights, in one CUDA graph; with programmatic dependent launch on and off."""
    from gpuworker.kernels.linear.gemv import gemv, gemv_rms_norm, pick_config

    def weight(name):
        (n, k), _ = SHAPES[name]
        return (torch.randn(n, k, device="cuda") / k**0.5).to(DTYPE)

    stack = [{name: weight(name) for name in ("qkv", "o_proj", "gate_up", "down")} for _ in range(layers)]
    config = {name: pick_config(1, *SHAPES[name][0]) for name in ("qkv", "o_proj", "gate_up", "down")}
    norm_weight = torch.ones(SHAPES["o_proj"][0][0], device="cuda", dtype=DTYPE)
    x0 = torch.randn(1, norm_weight.numel(), device="cuda").to(DTYPE)
    weight_bytes = sum(w.numel() * ES for layer in stack for w in layer.values())

    def forward():
        hidden, residual = x0, None
        for layer in stack:
            qkv, residual = gemv_rms_norm(hidden, residual, norm_weight, 1e-5, layer["qkv"], config=config["qkv"])
            hidden = gemv(qkv[:, : norm_weight.numel()], layer["o_proj"], config=config["o_proj"])
            gate_up, residual = gemv_rms_norm(
                hidden, residual, norm_weight, 1e-5, layer["gate_up"], config=config["gate_up"]
            )
            hidden = gemv(gate_up, layer["down"], silu_mul_input=True, config=config["down"])
        return hidden

    rows = []
    for pdl in ("0", "1"):
        os.environ["GPUWORKER_PDL"] = pdl  # read at each launch
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 20
        rows.append(
            {
                "pdl": pdl == "1",
                "layers": layers,
                "ms": ms,
                "weight_GB": weight_bytes / 1e9,
                "GBps": weight_bytes / ms / 1e6,
                "copy_GBps": copy_gbps,
            }
        )
        print(
            f"  PDL {'on ' if pdl == '1' else 'off'}: {ms:.3f} ms for {weight_bytes / 1e9:.2f} GB of weights, "
            f"{weight_bytes / ms / 1e6:.0f} GB/s ({100 * weight_bytes / ms / 1e6 / copy_gbps:.0f}% of copy)"
        )
        del graph
    os.environ.pop("GPUWORKER_PDL")
    return rows


def config_records(results: list[dict], shapes: str) -> tuple[list[dict], list[dict]]:
    """(records, removals) for gpuworker/kernels/configs/gemv at WRITTEN_ROWS: the fastest config of
    each shape where it beat cuBLAS, else the shape's record taken out (cuBLAS runs it)."""
    from gpuworker.kernels.linear.gemv import m_bucket

    records, removals = [], []
    for r in results:
        if r["M"] not in WRITTEN_ROWS or "cublas_us" not in r:
            continue
        key = {"weight_dtype": "bfloat16", "n": r["N"], "k": r["K"], "m": m_bucket(r["M"])}
        if "best_config" in r and r["speedup"] > 1.0:
            records.append(key | {"config": r["best_config"], "note": f"{shapes} {r['shape']}"})
        else:
            removals.append(key)
    return records, removals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="check every config against F.linear without timing (tiny shapes on a CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="M = 1 and 4 only")
    parser.add_argument(
        "--layer-chain",
        action="store_true",
        help="only the 32-layer chain of Llama-3-8B's batch-1 projections (PDL on and off)",
    )
    parser.add_argument(
        "--shapes",
        choices=sorted(SHAPE_SETS),
        default="llama-3-8b",
        help="whose decode projections to time (default: llama-3-8b)",
    )
    add_write_configs_option(parser, "gpuworker/kernels/configs/gemv")
    args = parser.parse_args()
    start = start_kernel_sweep("gemv.py", args.check_only)
    device, timed, env, copy_gbps = start.device, start.timed, start.env, start.copy_gbps
    if args.write_configs and (not timed or args.layer_chain):
        parser.error("--write-configs needs a timed sweep on a GPU (not --check-only or --layer-chain)")
    on_cuda = device == "cuda"
    from gpuworker.kernels.linear.gemv import CANDIDATES

    torch.manual_seed(0)
    model_shapes = SHAPE_SETS[args.shapes]
    shapes = model_shapes if on_cuda else TINY_SHAPES
    rows = (1, 4) if args.quick else ROWS
    if timed:
        if args.layer_chain:
            write_json("gemv_layer_chain", {"environment": env, "rows": layer_chain(copy_gbps)})
            return

    results, sweep = [], []
    for name, ((n, k), _) in shapes.items():
        shape_rows, shape_sweep = run_shape(name, n, k, rows, CANDIDATES, device=device, timed=timed)
        results += shape_rows
        sweep += shape_sweep
        print(f"  {name} ({n}x{k}) done")
    down = [r for r in results if r["shape"] == ("down" if on_cuda else "deep")]
    fused = []
    if down:  # a dense MLP's down projection (an MoE model has none outside its experts)
        n, k = down[0]["N"], down[0]["K"]
        fused = run_fused_down(
            n, k, rows, {r["M"]: r["best_config"] for r in down if "best_config" in r}, device=device, timed=timed
        )

    payload = {
        "environment": env,
        "shapes": args.shapes,
        "dtype": str(DTYPE),
        "copy_bandwidth_GBps": copy_gbps,
        "timed": timed,
        "results": results,
        "fused_down": fused,
        "sweep": sweep,
    }
    if timed:
        tuned = {}
        for r in results:
            if "best_config" in r and r["speedup"] > 1.0:
                tuned.setdefault((r["N"], r["K"]), {})[r["M"]] = r["best_config"]
        payload["tuned"] = {f"{n}x{k}": v for (n, k), v in tuned.items()}
        payload["step_estimate"] = step_estimate(results, model_shapes)
    suffix = "" if args.shapes == "llama-3-8b" else f"_{args.shapes}"
    write_json(("gemv" if timed else "gemv_check") + suffix, payload)

    print_results(results, fused, copy_gbps)
    if timed:
        print(f"\nlinear layers per decode step ({args.shapes}: {model_shapes['qkv'][1]} layers + lm_head):")
        for m, e in payload["step_estimate"].items():
            print(
                f"  M={m}: cuBLAS {e['cublas_ms']:.3f} ms, "
                f"best of cuBLAS/Triton per shape {e['best_of_both_ms']:.3f} ms"
            )
        print("\nwinners where Triton beat cuBLAS, {(N, K): {M: config}}:")
        for (n, k), by_m in tuned.items():
            print(f"    ({n}, {k}): {by_m!r},")
        if args.write_configs:
            from gpuworker.kernels.linear.gemv import TABLE_KEY

            write_configs("gemv", TABLE_KEY, *config_records(results, args.shapes))
    failed = [e for e in sweep if not e.get("ok")] + [r for r in fused if not r["ok"]]
    if failed:
        raise SystemExit(f"{len(failed)} gemv result(s) disagreed with F.linear or failed to run")


if __name__ == "__main__":
    main()
