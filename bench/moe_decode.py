"""MoE decode benchmark: the decode kernels (gpuworker.kernels.moe.decode) against the grouped ones
(kernels.fused_moe, today's path) at Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top-8, expert
intermediate 768), M = 1, 2, 4, 8 tokens, bf16, on one GPU.

    PYTHONPATH=. python bench/moe_decode.py [--quick]       # H200: 1-2 minutes, mostly Triton compiles
    PYTHONPATH=. python bench/moe_decode.py --check-only    # no timing; on a CPU: tiny shapes, float32
                                                            # (the interpreter truncates to bf16), 2 tiles each

A call is the layer after its router GEMM: routing (route_top_k, or torch's softmax and top-k for the
grouped path) and the experts. Every config is first checked against moe_decode_reference (same
routing); one that disagrees is reported and skipped. The sweep times each gate/up tile with the
default down tile and each down tile with the default gate/up tile, then the best of each together
(and that pair with programmatic dependent launch off), and the routing alone. Times are medians of
CUDA-graph replays over input sets whose routings differ, alternating between two copies of the
experts (2 x 1.2 GB), so the H200's L2 holds neither the experts of one call nor those of the next;
launch overhead is out. GB/s counts the expert weights the call's routing reads (each distinct
expert once) against the measured copy bandwidth (read + write). Prints the choice per token count and
writes moe_decode.json to $OUT (or bench/results/); with --write-configs it merges the choices into
gpuworker/kernels/configs/moe_decode/<this GPU>.json.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import add_write_configs_option, start_kernel_sweep, write_configs, write_json

DTYPE = torch.bfloat16
ES = 2  # bytes per bf16 element
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # bench/configs/qwen3-30b-a3b
ROWS = (1, 2, 4, 8)
# --check-only on a CPU: ragged tiny shapes, top-8 of 16 experts and top-2 of 8.
TINY_SHAPES = ((96, 80, 16, 8), (64, 48, 8, 2))
WEIGHT_COPIES = 2
# Candidate tiles: rows per program (programs per SM), K per step, warps, pipeline stages (bytes in
# flight per program). The first of each list is moe_decode.DEFAULT_CONFIG's.
GATE_UP_TILES = (
    "n16-k256-w4-p3",
    "n16-k256-w4-p4",
    "n8-k512-w4-p3",
    "n32-k128-w4-p3",
    "n16-k512-w8-p2",
    "n8-k256-w2-p4",
    "n4-k512-w2-p3",
    "n16-k128-w4-p4",
)
DOWN_TILES = (
    "n8-k256-w4-p3",
    "n8-k256-w4-p5",
    "n4-k256-w2-p3",
    "n4-k256-w2-p5",
    "n16-k256-w4-p3",
    "n8-k128-w2-p4",
    "n2-k256-w2-p3",
    "n16-k128-w4-p4",
)


def max_error(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, bool]:
    err = (got.float() - expected.float()).abs().max().item()
    # A few bf16 steps of the largest output: rounding and summation order, not a wrong answer.
    return err, err <= 0.02 * max(1.0, expected.float().abs().max().item())


def make_problem(
    m: int, hidden: int, inter: int, experts: int, top_k: int, sets: int, device: str, dtype: torch.dtype
) -> dict:
    """Two copies of the experts and `sets` inputs (x, router logits), scaled so outputs are ~N(0, 1)."""
    copies = WEIGHT_COPIES if device == "cuda" else 1
    w13 = [(torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype) for _ in range(copies)]
    w2 = [(torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype) for _ in range(copies)]
    xs = [torch.randn(m, hidden, device=device).to(dtype) for _ in range(sets)]
    logits = [torch.randn(m, experts, device=device).to(dtype) for _ in range(sets)]
    return {"w13": w13, "w2": w2, "x": xs, "logits": logits}


def expert_bytes(problem: dict, top_k: int) -> float:
    """Mean bytes of expert weights one call reads: each distinct chosen expert's w13 and w2 once."""
    from gpuworker.kernels.moe.decode import route_reference

    w13, w2 = problem["w13"][0], problem["w2"][0]
    per_expert = (w13[0].numel() + w2[0].numel()) * ES
    distinct = [route_reference(lg, top_k, True)[1].unique().numel() for lg in problem["logits"]]
    return per_expert * sum(distinct) / len(distinct)


def sweep_configs(default, tiles: int | None = None) -> tuple[list, list]:
    """(the gate/up tiles with the default down tile, the down tiles with the default gate/up tile),
    the first `tiles` of each list if given."""
    from gpuworker.kernels.moe.decode import DecodeConfig, Tile

    return (
        [DecodeConfig(Tile.parse(t), default.down) for t in GATE_UP_TILES[:tiles]],
        [DecodeConfig(default.gate_up, Tile.parse(t)) for t in DOWN_TILES[:tiles]],
    )


def run_rows(m: int, shape: tuple[int, int, int, int], *, device: str, timed: bool) -> tuple[dict, list[dict]]:
    from gpuworker.kernels.moe.decode import (
        DEFAULT_CONFIG,
        DecodeConfig,
        moe_decode,
        moe_decode_reference,
        route_reference,
        route_top_k,
    )
    from gpuworker.kernels.moe.fused import fused_moe

    hidden, inter, experts, top_k = shape
    sets = 8 if timed else 1
    dtype = DTYPE if device == "cuda" else torch.float32
    problem = make_problem(m, hidden, inter, experts, top_k, sets, device, dtype)
    w13, w2, xs, logits = problem["w13"], problem["w2"], problem["x"], problem["logits"]
    moved = expert_bytes(problem, top_k)
    weights0, ids0 = route_reference(logits[0], top_k, True)
    expected = moe_decode_reference(xs[0], w13[0], w2[0], weights0, ids0)
    row = {
        "M": m,
        "hidden": hidden,
        "inter": inter,
        "experts": experts,
        "top_k": top_k,
        "expert_bytes": moved,
        "sets": sets,
    }

    def decode_call(i: int, config):
        weights, ids = route_top_k(logits[i], top_k, True)
        return moe_decode(xs[i], w13[i % len(w13)], w2[i % len(w2)], weights, ids, config=config)

    def grouped_call(i: int):
        weights, ids = route_reference(logits[i], top_k, True)
        return fused_moe(xs[i], w13[i % len(w13)], w2[i % len(w2)], weights, ids)

    def measure(name: str, call) -> dict:
        entry = {"M": m, "config": name}
        try:
            err, ok = max_error(call(0), expected)
            entry.update(max_abs_err=err, ok=ok)
            if ok and timed:
                from kernel_times import graph_time_us

                us = graph_time_us([lambda i=i: call(i) for i in range(sets)])
                entry.update(us=us, GBps=moved / us / 1e3)
        except Exception as exc:  # noqa: BLE001 - a config that cannot compile/run is reported, not fatal
            entry.update(ok=False, error=repr(exc)[:300])
        status = f"{entry['us']:8.1f} us" if "us" in entry else ("ok" if entry.get("ok") else "FAILED")
        print(
            f"  M={m} {name:45s} {status}  max abs err {entry.get('max_abs_err', float('nan')):.3g}"
            f"{'  ' + entry['error'] if 'error' in entry else ''}"
        )
        return entry

    routed = route_top_k(logits[0], top_k, True)[1]
    row["routing_ids_equal"] = bool(torch.equal(routed, ids0))
    sweep = [measure("grouped", grouped_call)]
    # The interpreter runs a call in about a second: two tiles of each kernel there.
    gate_up_configs, down_configs = sweep_configs(DEFAULT_CONFIG, None if device == "cuda" else 2)
    for config in dict.fromkeys(gate_up_configs + down_configs):  # the default config once
        sweep.append(measure(config.name, lambda i, c=config: decode_call(i, c)))
    decode = {e["config"]: e for e in sweep[1:] if "us" in e}
    if decode:
        # The best gate/up tile (timed with the default down) with the best down tile (with the default gate/up).
        best_gate_up = min(
            (c for c in gate_up_configs if c.name in decode), key=lambda c: decode[c.name]["us"], default=DEFAULT_CONFIG
        ).gate_up
        best_down = min(
            (c for c in down_configs if c.name in decode), key=lambda c: decode[c.name]["us"], default=DEFAULT_CONFIG
        ).down
        combined = DecodeConfig(best_gate_up, best_down)
        if combined.name not in decode:
            entry = measure(combined.name, lambda i: decode_call(i, combined))
            sweep.append(entry)
            if "us" in entry:
                decode[combined.name] = entry
        best = min(decode, key=lambda name: decode[name]["us"])
        saved = os.environ.get("GPUWORKER_PDL")
        os.environ["GPUWORKER_PDL"] = "0"  # read at each launch
        chosen = DecodeConfig.parse(best)
        no_pdl = measure(best + " (PDL off)", lambda i: decode_call(i, chosen))
        if saved is None:
            os.environ.pop("GPUWORKER_PDL")
        else:
            os.environ["GPUWORKER_PDL"] = saved
        sweep.append({**no_pdl, "pdl": False})
        # The routing alone, the kernel against torch's softmax, top-k and renormalisation.
        from kernel_times import graph_time_us

        row["route_kernel_us"] = graph_time_us([lambda i=i: route_top_k(logits[i], top_k, True) for i in range(sets)])
        row["route_torch_us"] = graph_time_us(
            [lambda i=i: route_reference(logits[i], top_k, True) for i in range(sets)]
        )
        grouped_us = sweep[0].get("us")
        row.update(
            best_config=best,
            best_us=decode[best]["us"],
            best_GBps=decode[best]["GBps"],
            default_us=decode.get(DEFAULT_CONFIG.name, {}).get("us"),
            grouped_us=grouped_us,
            best_no_pdl_us=no_pdl.get("us"),
            speedup=grouped_us / decode[best]["us"] if grouped_us else None,
        )
    row["all_ok"] = all(e.get("ok") for e in sweep) and row["routing_ids_equal"]
    return row, sweep


def tuned_entry(results: list[dict]) -> dict[int, str]:
    """{M: "grouped" where the grouped kernels were at least as fast, else the best decode config}."""
    return {
        r["M"]: ("grouped" if r.get("speedup") is not None and r["speedup"] <= 1.0 else r["best_config"])
        for r in results
        if "best_config" in r
    }


def config_records(results: list[dict]) -> list[dict]:
    """gpuworker/kernels/configs/moe_decode's records: tuned_entry's choice per token count (a power of
    2, its own bucket) at the swept shape."""
    return [
        {
            "hidden": HIDDEN,
            "inter": INTER,
            "top_k": TOP_K,
            "tokens": m,
            "config": name,
            "note": "qwen3-30b-a3b MoE layer",
        }
        for m, name in tuned_entry(results).items()
    ]


def print_timed(results: list[dict], copy_gbps: float) -> None:
    def fmt(value, width):
        return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}s}"

    print(
        f"\n== MoE layer (routing + experts), bf16, {EXPERTS} experts top-{TOP_K}, "
        f"copy bandwidth {copy_gbps:.0f} GB/s =="
    )
    print(
        f"{'M':>2s} {'grouped us':>10s} {'default us':>10s} {'best us':>8s} {'GB/s':>6s} {'%copy':>5s} "
        f"{'speedup':>7s} {'no-PDL us':>9s}  best config"
    )
    for r in results:
        if "best_us" not in r:
            print(f"{r['M']:2d}  no decode config passed the check")
            continue
        print(
            f"{r['M']:2d} {fmt(r['grouped_us'], 10)} {fmt(r['default_us'], 10)} {r['best_us']:8.1f} "
            f"{r['best_GBps']:6.0f} {100 * r['best_GBps'] / copy_gbps:4.0f}% "
            f"{(r['speedup'] or 0):6.2f}x {fmt(r['best_no_pdl_us'], 9)}  {r['best_config']}"
        )
    print(
        "routing alone (us): "
        + ", ".join(
            f"M={r['M']} kernel {r['route_kernel_us']:.1f} / torch {r['route_torch_us']:.1f}"
            for r in results
            if "route_kernel_us" in r
        )
    )
    first = results[0] if results else {}
    if first.get("M") == 1 and first.get("grouped_us") and first.get("best_us"):
        print(
            f"\n48 layers at M=1: grouped {48 * first['grouped_us'] / 1e3:.3f} ms, "
            f"decode {48 * first['best_us'] / 1e3:.3f} ms"
        )
    print(f"\nchoice per token count at hidden {HIDDEN}, expert intermediate {INTER}, top-{TOP_K}:")
    print(f"    {tuned_entry(results)!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="check every config against the reference without timing (tiny shapes on a CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="M = 1 and 4 only")
    add_write_configs_option(parser, "gpuworker/kernels/configs/moe_decode")
    args = parser.parse_args()
    start = start_kernel_sweep("moe_decode.py", args.check_only)
    device, timed, env, copy_gbps = start.device, start.timed, start.env, start.copy_gbps
    if args.write_configs and not timed:
        parser.error("--write-configs needs a timed sweep on a GPU (not --check-only)")
    on_cuda = device == "cuda"
    os.environ.pop("GPUWORKER_MOE_DECODE", None)  # every config is passed explicitly
    from gpuworker.kernels.moe.decode import DECODE_MAX_PAIRS

    torch.manual_seed(0)
    shapes = ((HIDDEN, INTER, EXPERTS, TOP_K),) if on_cuda else TINY_SHAPES
    rows = (1, 4) if args.quick else ROWS
    results, sweep = [], []
    for shape in shapes:
        for m in rows:
            if m * shape[3] > DECODE_MAX_PAIRS:
                continue  # the engine takes the grouped kernels there
            row, row_sweep = run_rows(m, shape, device=device, timed=timed)
            results.append(row)
            sweep += row_sweep
            if device == "cuda":
                torch.cuda.empty_cache()

    payload = {
        "environment": env,
        "dtype": str(DTYPE),
        "copy_bandwidth_GBps": copy_gbps,
        "timed": timed,
        "results": results,
        "sweep": sweep,
    }
    if timed:
        payload["tuned"] = {f"{HIDDEN}x{INTER}x{TOP_K}": tuned_entry(results)}
        print_timed(results, copy_gbps)
        if args.write_configs:
            from gpuworker.kernels.moe.decode import TABLE_KEY

            write_configs("moe_decode", TABLE_KEY, config_records(results))
    else:
        for r in results:
            print(
                f"M={r['M']} {r['hidden']}x{r['inter']} top-{r['top_k']} of {r['experts']}: "
                f"{'ok' if r['all_ok'] else 'MISMATCH'}"
            )
    write_json("moe_decode" if timed else "moe_decode_check", payload)
    failed = [e for e in sweep if not e.get("ok")] + [r for r in results if not r["routing_ids_equal"]]
    if failed:
        raise SystemExit(f"{len(failed)} MoE decode result(s) disagreed with the reference or failed to run")


if __name__ == "__main__":
    main()
