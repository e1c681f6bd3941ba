"""Sampling kernel benchmark: gpuworker.kernels.sampling.sample's launch configs against the kernel in its
plainest form (BASELINE_CONFIG: every pass over the row, every row searching its thresholds, no draw
first), at Llama-3-8B's vocabulary (128,256), batch 1, 64 and 512.

    PYTHONPATH=. python bench/sampling.py [--quick]      # H200: ~5 min (--quick: 1-2), mostly compiles
    PYTHONPATH=. python bench/sampling.py --check-only   # no timing; on a CPU: tiny vocab, interpreter

Modes, temperature 0.8 unless greedy: greedy (torch's argmax, what the engine runs when every row is
greedy, and the kernel with temperature 0), top-k 200, top-p 0.95, min-p 0.05, and seeded top-p 0.95
(request i's seed i, as bench/throughput.py's t0.8-p0.95-seeded; the other modes draw random seeds).
Logits are float32 (the engine's): "flat" is randn * 1.3, what the benchmarks' random-weight
Llama-3-8B gives (top-p 0.95 keeps about half the vocabulary), "peaked" is 4x that, nearer a
trained model's.

First a coordinate descent over the config's fields at batch 512, top-p 0.95, flat logits (the
slowest case), starting from DEFAULT_CONFIG; then the baseline, the default, the winner and a few
variants of it at every batch, mode and logits kind. Every config is checked against
sample_reference (the same tokens wherever the kept sets agree) before it is timed; one that
disagrees is reported and skipped. Times are medians of CUDA-graph replays over enough logits copies
that the L2 cannot hold them; GB/s counts one read of the logits. Prints the fastest config per batch
and writes sampling.json to $OUT (or bench/results/); with --write-configs it merges them into
gpuworker/kernels/configs/sample/<this GPU>.json.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from common import add_write_configs_option, start_kernel_sweep, write_configs, write_json

VOCAB = 128256
BATCHES = (1, 64, 512)
TOP_K, TOP_P, MIN_P, TEMPERATURE = 200, 0.95, 0.05, 0.8
MODES = ("greedy", "top-k", "top-p", "min-p", "seeded-top-p")
# The values the descent tries for each field, in this order (blocks before what depends on them).
DESCENT = {
    "num_warps": (4, 8, 16),
    "block": (512, 1024, 2048),
    "search_block": (128, 256, 512),
    "num_thresholds": (4, 8, 16),
    "prefetch": (0, 1, 2, 3),
    "list_capacity": (0, 8192, 16384),
    "max_registers": (None, 80, 96, 128),
    "max_draws": (1, 3, 6),
}


def make_logits(kind: str, num_rows: int, vocab: int, device: str, generator: torch.Generator) -> torch.Tensor:
    logits = torch.randn(num_rows, vocab, generator=generator, device=device) * 1.3
    return logits * 4 if kind == "peaked" else logits


def mode_params(mode: str, num_rows: int, vocab: int, device: str, generator: torch.Generator) -> dict:
    """sample()'s keyword arguments for every row in `mode`."""
    temperature = torch.full((num_rows,), 0.0 if mode == "greedy" else TEMPERATURE, device=device)
    if mode == "seeded-top-p":
        seeds = torch.arange(num_rows, device=device)
    else:
        seeds = torch.randint(0, 2**62, (num_rows,), generator=generator, device=device)
    params = {"temperature": temperature, "seeds": seeds}
    if mode == "top-k":
        params["top_k"] = torch.full((num_rows,), min(TOP_K, vocab // 3), device=device)
    elif mode in ("top-p", "seeded-top-p"):
        params["top_p"] = torch.full((num_rows,), TOP_P, device=device)
    elif mode == "min-p":
        params["min_p"] = torch.full((num_rows,), MIN_P, device=device)
    return params


def check(config, logits: torch.Tensor, params: dict, expected: torch.Tensor) -> str | None:
    """None if `config` draws the reference's tokens, else why not. The call is the timed one (no
    num_kept output: that would be another variant to compile): a row whose top-p or min-p boundary
    falls within rounding of the threshold may keep one token more or less than the reference
    (float sums added in another order), which changes its token only if that token wins the draw."""
    from gpuworker.kernels.sampling.sample import sample

    try:
        tokens = sample(logits, config=config, **params)
    except Exception as exc:  # noqa: BLE001 - a config that cannot compile or run is reported, not fatal
        return repr(exc)[:300]
    differ = (tokens != expected).sum().item()
    if differ > 0.01 * len(tokens):
        return f"different tokens on {differ} of {len(tokens)} rows"
    return None


def time_config(config, logit_sets: list[torch.Tensor], params: dict) -> float:
    from gpuworker.kernels.sampling.sample import sample
    from kernel_times import graph_time_us

    return graph_time_us([lambda x=x: sample(x, config=config, **params) for x in logit_sets])


def measure(config, batch: int, mode: str, kind: str, cache: dict, *, device: str, timed: bool) -> dict:
    """One config at one (batch, mode, logits kind): checked, then timed."""
    key = (batch, mode, kind)
    if key not in cache:
        generator = torch.Generator(device=device).manual_seed(batch * 7 + MODES.index(mode))
        vocab = VOCAB if timed else 600
        copies = 1
        if timed:
            from kernel_times import num_sets

            copies = num_sets(batch * vocab * 4, cap=16)
        from gpuworker.kernels.sampling.sample import sample_reference

        logit_sets = [make_logits(kind, batch, vocab, device, generator) for _ in range(copies)]
        params = mode_params(mode, batch, vocab, device, generator)
        cache[key] = (logit_sets, params, sample_reference(logit_sets[0], **params)[0])
    logit_sets, params, expected = cache[key]
    row = {"batch": batch, "mode": mode, "logits": kind, "config": config.name}
    error = check(config, logit_sets[0], params, expected)
    row["ok"] = error is None
    if error:
        row["error"] = error
        print(f"  batch {batch} {mode} {kind} {config.name}: FAILED {error}")
    elif timed:
        row["us"] = time_config(config, logit_sets, params)
        row["GBps"] = logit_sets[0].numel() * 4 / row["us"] / 1e3
    return row


def argmax_us(batch: int, cache: dict) -> float:
    from kernel_times import graph_time_us

    logit_sets = cache[(batch, "greedy", "flat")][0]
    return graph_time_us([lambda x=x: x.argmax(dim=-1) for x in logit_sets])


def descend(start, batch: int, cache: dict, *, device: str, timed: bool, log: list) -> object:
    """Coordinate descent over DESCENT's fields at (batch, top-p, flat): each field in turn takes the
    value that times fastest with the others fixed."""
    best = start
    row = measure(best, batch, "top-p", "flat", cache, device=device, timed=timed)
    log.append(row)
    best_us = row.get("us", float("inf"))
    for field, values in DESCENT.items():
        for value in values:
            if getattr(best, field) == value:
                continue
            try:
                candidate = dataclasses.replace(best, **{field: value})
            except ValueError:
                continue
            row = measure(candidate, batch, "top-p", "flat", cache, device=device, timed=timed)
            log.append(row)
            if row.get("us", float("inf")) < best_us:
                best, best_us = candidate, row["us"]
        print(f"  after {field}: {best.name} {best_us:.1f} us" if timed else f"  {field} checked")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="check the configs against the reference without timing (tiny vocab on a CPU)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="no descent: baseline, default and this GPU's tuned configs only"
    )
    add_write_configs_option(parser, "gpuworker/kernels/configs/sample")
    args = parser.parse_args()
    sweep = start_kernel_sweep("sampling.py", args.check_only, copy_bandwidth=False)
    device, timed, env = sweep.device, sweep.timed, sweep.env
    if args.write_configs and not timed:
        parser.error("--write-configs needs a timed sweep on a GPU (not --check-only)")
    from gpuworker.kernels.sampling.sample import BASELINE_CONFIG, DEFAULT_CONFIG, SamplingConfig, tuned_configs

    cache: dict = {}
    descent: list[dict] = []
    batches = BATCHES if timed else (1, 8)
    configs = [BASELINE_CONFIG, DEFAULT_CONFIG, *tuned_configs(torch.device(device))]
    if not args.quick:
        if timed:
            winner = descend(DEFAULT_CONFIG, 512, cache, device=device, timed=timed, log=descent)
        else:  # the interpreter: a few small configs instead of the descent
            winner = SamplingConfig(block=64, search_block=32, num_thresholds=4, list_capacity=128, prefetch=2)
        configs.append(winner)
        if timed:  # more programs per row at small batches (the same compiled kernel)
            configs += [dataclasses.replace(winner, programs_per_sm=2), dataclasses.replace(winner, programs_per_sm=4)]
    configs = list(dict.fromkeys(configs))

    results = []
    for batch in batches:
        for kind in ("flat", "peaked"):
            for mode in MODES:
                for config in configs:
                    results.append(measure(config, batch, mode, kind, cache, device=device, timed=timed))
        print(f"  batch {batch} done")
    argmax = {batch: argmax_us(batch, cache) for batch in batches} if timed else {}

    payload = {
        "environment": env,
        "vocab": VOCAB if timed else 600,
        "timed": timed,
        "results": results,
        "descent": descent,
        "argmax_us": argmax,
        "configs": [dataclasses.asdict(c) | {"name": c.name} for c in configs],
    }
    failed = [r for r in results + descent if not r["ok"]]
    if timed:
        print_results(results, argmax, configs)
        payload["tuned"] = tuned = pick_tuned(results, configs)
        print("\nfastest total over modes and logits per batch:")
        for batch, name in tuned.items():
            print(f"    {batch}: {name}")
        if args.write_configs:
            from gpuworker.kernels.sampling.sample import TABLE_KEY

            write_configs("sample", TABLE_KEY, config_records(tuned, configs))
    else:
        for r in results:
            print(
                f"  batch {r['batch']:3d} {r['mode']:13s} {r['logits']:6s} {r['config']:40s} "
                f"{'ok' if r['ok'] else 'MISMATCH'}"
            )
    write_json("sampling" if timed else "sampling_check", payload)
    if failed:
        raise SystemExit(f"{len(failed)} sampling result(s) disagreed with the reference or failed to run")


def print_results(results: list[dict], argmax: dict, configs: list) -> None:
    baseline = configs[0].name
    by_key = {(r["batch"], r["mode"], r["logits"], r["config"]): r for r in results}
    print(f"\n== sampling kernel, vocab {VOCAB}, float32 logits: us per call (x baseline) ==")
    header = f"{'batch':>5s} {'mode':13s} {'logits':6s} {'argmax':>7s}"
    for i in range(len(configs)):
        header += f" {'c' + str(i):>15s}"
    print(header)
    for batch in sorted({r["batch"] for r in results}):
        for kind in ("flat", "peaked"):
            for mode in MODES:
                line = f"{batch:5d} {mode:13s} {kind:6s} {argmax.get(batch, 0.0) if mode == 'greedy' else 0.0:7.1f}"
                base = by_key.get((batch, mode, kind, baseline), {}).get("us")
                for config in configs:
                    us = by_key.get((batch, mode, kind, config.name), {}).get("us")
                    if us is None:
                        line += f" {'FAILED':>15s}"
                    else:
                        line += f" {us:8.1f} ({base / us:4.1f}x)" if base else f" {us:15.1f}"
                print(line)
    for i, config in enumerate(configs):
        print(f"  c{i}: {config.name}{'  (baseline)' if i == 0 else ''}")


def pick_tuned(results: list[dict], configs: list) -> dict[int, str]:
    """Per batch, the config with the least total time over every mode and logits kind it passed."""
    tuned = {}
    for batch in sorted({r["batch"] for r in results}):
        totals = {}
        for config in configs:
            rows = [r for r in results if r["batch"] == batch and r["config"] == config.name]
            if rows and all(r["ok"] for r in rows):
                totals[config.name] = sum(r["us"] for r in rows)
        if totals:
            tuned[batch] = min(totals, key=totals.get)
    return tuned


def config_records(tuned: dict[int, str], configs: list) -> list[dict]:
    """gpuworker/kernels/configs/sample's records: each batch bucket's fastest config, every field."""
    by_name = {config.name: config for config in configs}
    return [
        {"rows": batch, **dataclasses.asdict(by_name[name]), "note": f"vocabulary {VOCAB}, float32 logits"}
        for batch, name in tuned.items()
    ]


if __name__ == "__main__":
    main()
