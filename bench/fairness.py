"""Fair shares between tenants and priority classes inside the engine, against arrival-order
scheduling in the same run: `LLMEngine` stepped in real time under Poisson arrivals, one fresh
engine per scheduling policy (EngineConfig.scheduling "fcfs" or "fair").

    python bench/fairness.py [--duration 60] [--plot docs/fairness.png]
    python bench/fairness.py --replot bench/results/fairness.json          # the plot again, from the JSON
    python bench/fairness.py --device cpu --dtype float32 --config DIR --duration 2 ...   # a quick CPU run

Model: random weights of --config's shape (Llama-3-8B), load_format "dummy". Workload (seed 0):
prompts of U[--prompt-len] random token ids, outputs of U[--output-len] tokens, greedy, ignore_eos.

Capacity: the requests/s the engine completes when given --capacity-requests at once (offline, after
a warm-up). Then, each for --duration seconds of arrivals:
- two tenants: A at --quiet-share of capacity, B flooding at --flood-share of it; and A alone;
- interactive beside batch: the same interactive stream as A, beside a batch class whose requests
  (--flood-share of capacity for the duration, all sent at the start) fill the GPU.
When arrivals stop, the engine runs on until every request of the quiet stream has its first token
(at most another --duration), then the rest is aborted. A request that never got a first token
counts with the wait it had so far (a lower bound; the table says how many).

Per run: TTFT p50/p99 per tenant or class (from the request's arrival, so queueing counts), output
tok/s per tenant over the arrival window and in total, and Jain's fairness index of the weighted
service (prompt tokens 1, output tokens 2: the scheduler's own count) the two tenants got in the
steps where both had requests waiting. The figures the issue asks for print below the table:
A's TTFT p99 against A alone, total output tok/s of fair against arrival order, Jain's index, and
interactive TTFT p99 beside batch against no batch. Beside them: A's demand (its arrivals' weighted
tokens) over half the service both tenants got in the window (above 1, equal shares cannot keep up
with A, whatever the scheduler), and each run's steps, step times and preemptions with the engine's
limits. --policies and --workloads run a subset (A alone always runs: the figures' yardstick).
"""

from __future__ import annotations

import gc
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from common import (
    ROOT,
    add_engine_options,
    dummy_engine,
    engine_parser,
    environment,
    free_device_memory,
    load_hf_config,
    print_table,
    write_json,
)

POLICIES = ("fcfs", "fair")
WORKLOADS = ("tenants", "classes")


@dataclass(frozen=True)
class Arrival:
    at_s: float
    request_id: str
    tenant: str
    priority: str
    prompt: list[int]
    max_tokens: int


def jain_index(values: list[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one gets everything."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def poisson(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Arrival times at `rate` over the window, the first at 0 (so even a short window has one)."""
    times, t = [], 0.0
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def workload(args, rng: random.Random, vocab: int, tenant: str, times: list[float], priority="interactive"):
    return [
        Arrival(
            at_s,
            f"{tenant}-{i}",
            tenant,
            priority,
            [rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))],
            rng.randint(*args.output_len),
        )
        for i, at_s in enumerate(times)
    ]


def make_engine(args, policy: str):

    return dummy_engine(
        args,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        scheduling=policy,
        enable_prefix_caching=False,  # random prompts share nothing
    )


def warm_up(engine) -> None:
    """A prefill and decodes, not timed."""
    from gpuworker.engine import SamplingParams

    engine.generate([[1] * 32], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def release(engine) -> None:
    engine.shutdown()
    gc.collect()


def measure_capacity(args, vocab: int) -> float:
    """Requests/s the engine completes with --capacity-requests given at once."""
    from gpuworker.engine import SamplingParams

    rng = random.Random(args.seed + 1)
    requests = workload(args, rng, vocab, "capacity", [0.0] * args.capacity_requests)
    engine = make_engine(args, "fair")
    warm_up(engine)
    started = time.perf_counter()
    for r in requests:
        engine.add_request(
            r.request_id, r.prompt, SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - started
    release(engine)
    return len(requests) / seconds


def run(args, policy: str, arrivals: list[Arrival], quiet: str) -> dict:
    """Serve `arrivals` in real time on a fresh engine; figures per tenant (or class) name."""
    from gpuworker.engine import SamplingParams

    engine = make_engine(args, policy)
    warm_up(engine)
    by_id = {a.request_id: a for a in arrivals}
    pending = sorted(arrivals, key=lambda a: a.at_s)
    first_token: dict[str, float] = {}
    tokens_in_window: dict[str, int] = {}
    both_backlogged: dict[str, float] = {}  # weighted service in steps where every tenant waited
    served_before: dict[str, float] = {}
    tenants = sorted({a.tenant for a in arrivals})
    timeline: list[tuple[float, dict[str, float]]] = []
    step_s: list[float] = []
    wall0, start = time.time(), time.perf_counter()
    next_arrival = 0
    while True:
        now = time.perf_counter() - start
        while next_arrival < len(pending) and pending[next_arrival].at_s <= now:
            a = pending[next_arrival]
            params = SamplingParams(
                temperature=0.0,
                max_tokens=a.max_tokens,
                ignore_eos=True,
                output_kind="delta",
                tenant=a.tenant,
                priority=a.priority,
            )
            engine.add_request(a.request_id, a.prompt, params, arrival_time=wall0 + a.at_s)
            next_arrival += 1
        quiet_done = all(a.request_id in first_token for a in arrivals if a.tenant == quiet and a.at_s <= now)
        if next_arrival == len(pending) and (quiet_done or now > 2 * args.duration):
            break
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, pending[next_arrival].at_s - now)))
            continue
        waiting = {seq.group.params.tenant for seq in engine.scheduler.waiting}
        before = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - before)
        served = _served(engine)
        if waiting >= set(tenants) and now <= args.duration:
            for tenant in tenants:
                gained = served.get(tenant, 0.0) - served_before.get(tenant, 0.0)
                both_backlogged[tenant] = both_backlogged.get(tenant, 0.0) + gained
        served_before = served
        stepped = time.perf_counter() - start
        timeline.append((stepped, served))
        for out in outputs:
            tenant = by_id[out.request_id].tenant
            if out.request_id not in first_token and out.outputs[0].token_ids:
                first_token[out.request_id] = out.metrics.first_token_time - out.metrics.arrival_time
            if stepped <= args.duration:
                tokens_in_window[tenant] = tokens_in_window.get(tenant, 0) + len(out.outputs[0].token_ids)
    ended = time.perf_counter() - start
    preemptions = engine.scheduler.num_preemptions
    config = engine.scheduler.config
    limits = {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "kv_tokens": config.num_kv_blocks * config.block_size,
    }
    for request_id in engine.unfinished_request_ids():
        engine.abort(request_id)
    release(engine)
    free_device_memory(args.device)
    window = min(args.duration, ended)
    in_window = [served for at, served in timeline if at <= args.duration]
    per_tenant = {}
    for tenant in tenants:
        mine = [a for a in arrivals if a.tenant == tenant and a.at_s <= args.duration]
        waits = [first_token.get(a.request_id, ended - a.at_s) for a in mine]
        per_tenant[tenant] = {
            "requests": len(mine),
            "unserved": sum(a.request_id not in first_token for a in mine),
            "ttft_p50_s": percentile(waits, 50),
            "ttft_p99_s": percentile(waits, 99),
            "output_tok_s": tokens_in_window.get(tenant, 0) / window,
            # What its arrivals ask for and what it got, in the scheduler's weighted tokens.
            "offered_weighted_tokens": sum(_weighted(len(a.prompt), a.max_tokens) for a in mine),
            "served_weighted_tokens": in_window[-1].get(tenant, 0.0) if in_window else 0.0,
        }
    return {
        "policy": policy,
        "tenants": per_tenant,
        "output_tok_s": sum(tokens_in_window.values()) / window,
        "backlogged_service": both_backlogged,
        "jain_index": jain_index(list(both_backlogged.values())) if len(tenants) > 1 and both_backlogged else None,
        "timeline": [[round(t, 3), s] for t, s in timeline[:: max(1, len(timeline) // 400)]],
        # Where the time went: steps, their length, and sequences recomputed for want of KV blocks.
        "steps": len(step_s),
        "step_ms_p50": 1e3 * percentile(step_s, 50) if step_s else None,
        "step_ms_p99": 1e3 * percentile(step_s, 99) if step_s else None,
        "step_ms_max": 1e3 * max(step_s, default=0.0),
        "preemptions": preemptions,
        "limits": limits,
    }


def _weighted(prompt_tokens: int, output_tokens: int) -> float:
    """A request's whole cost as the fair scheduler counts it (engine.fair_share's costs)."""
    from gpuworker.engine.fair_share import INPUT_TOKEN_COST, OUTPUT_TOKEN_COST

    return INPUT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens


def _served(engine) -> dict[str, float]:
    """Weighted tokens served per tenant so far (the scheduler's count, read every step)."""
    served: dict[str, float] = {}
    for (tenant, _priority), tokens in engine.scheduler.waiting.counters.served.items():
        served[tenant] = served.get(tenant, 0.0) + tokens
    return served


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:,.0f}"


def report(result: dict) -> None:
    env, runs = result["env"], result["runs"]
    rows = [
        ("model", f"{result['model']} on {env['gpu']} (commit {env['commit']})"),
        ("capacity", f"{result['capacity_requests_per_s']:.2f} requests/s (offline, all at once)"),
        ("run: tenant", "requests (unserved) | TTFT p50/p99 ms | output tok/s | Jain's index while both wait"),
    ]
    for name, r in runs.items():
        for tenant, t in r["tenants"].items():
            jain = r["jain_index"]
            rows.append(
                (
                    f"{name}: {tenant}",
                    f"{t['requests']} ({t['unserved']}) | {_ms(t['ttft_p50_s'])}/{_ms(t['ttft_p99_s'])} | "
                    f"{t['output_tok_s']:,.0f} of {r['output_tok_s']:,.0f} | {'-' if jain is None else f'{jain:.3f}'}",
                )
            )
    limits = next(iter(runs.values())).get("limits")
    if limits:
        rows.append(("engine limits", ", ".join(f"{k} {v:,}" for k, v in limits.items())))
    rows.append(("run: engine", "steps | step ms p50/p99/max | preemptions"))
    for name, r in runs.items():
        if "steps" in r:  # results written before these were kept have none
            rows.append(
                (
                    f"{name}: engine",
                    f"{r['steps']:,} | {r['step_ms_p50']:.1f}/{r['step_ms_p99']:.1f}/{r['step_ms_max']:.1f} | "
                    f"{r['preemptions']:,}",
                )
            )
    for label, value in result["figures"].items():
        rows.append((label, value))
    print_table("fair shares and priority classes", rows)


def figures(runs: dict) -> dict[str, str]:
    """The issue's figures that the runs made allow: each ratio with what it is measured against."""
    alone = runs["A alone"]["tenants"]["A"]["ttft_p99_s"]
    out = {}
    for policy in POLICIES:
        two = runs.get(f"two tenants, {policy}")
        if two:
            out[f"{policy}: A TTFT p99 / alone"] = f"{two['tenants']['A']['ttft_p99_s'] / alone:.2f}x (goal <= 1.5x)"
            out[f"{policy}: A's demand / half the service"] = _demand_over_half(two)
            out[f"{policy}: Jain's index"] = f"{two['jain_index']:.3f} (goal >= 0.95)" if two["jain_index"] else "-"
        beside = runs.get(f"interactive + batch, {policy}")
        if beside:
            p99 = beside["tenants"]["interactive"]["ttft_p99_s"]
            out[f"{policy}: interactive TTFT p99 / no batch"] = f"{p99 / alone:.2f}x (goal <= 1.10x)"
    if "two tenants, fair" in runs and "two tenants, fcfs" in runs:
        fair, fcfs = runs["two tenants, fair"]["output_tok_s"], runs["two tenants, fcfs"]["output_tok_s"]
        out["fair / fcfs total output tok/s"] = f"{fair / fcfs:.3f} (goal >= 0.95)"
    return out


def _demand_over_half(two: dict) -> str:
    """A's arrivals' weighted tokens over half of what both tenants were served in the window: above
    1, equal shares cannot serve A at its rate, whatever the scheduler (the window is too short for a
    steady state, or A's rate is above half the capacity)."""
    tenants = two["tenants"]
    if "offered_weighted_tokens" not in tenants["A"]:  # results written before these were kept
        return "-"
    half = sum(t["served_weighted_tokens"] for t in tenants.values()) / 2
    return f"{tenants['A']['offered_weighted_tokens'] / half:.2f} (above 1: A's share cannot keep up)" if half else "-"


def plot(result: dict, path: Path) -> None:
    """Left: each tenant's cumulative weighted service over time, arrival order dashed and fair solid.
    Right: TTFT p99 of the quiet stream (A, or interactive) alone and beside the flood, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for policy, style in (("fcfs", "--"), ("fair", "-")):
        timeline = runs[f"two tenants, {policy}"]["timeline"]
        for tenant, color in (("A", "tab:blue"), ("B", "tab:orange")):
            left.plot(
                [t for t, _ in timeline],
                [s.get(tenant, 0.0) for _, s in timeline],
                style,
                color=color,
                label=f"{tenant}, {policy}",
            )
    left.set(title="weighted tokens served (A: half capacity, B: twice)", xlabel="seconds")
    left.legend()
    labels, values = ["A alone"], [runs["A alone"]["tenants"]["A"]["ttft_p99_s"]]
    for policy in POLICIES:
        labels += [f"A beside B\n{policy}", f"interactive\nbeside batch\n{policy}"]
        values += [
            runs[f"two tenants, {policy}"]["tenants"]["A"]["ttft_p99_s"],
            runs[f"interactive + batch, {policy}"]["tenants"]["interactive"]["ttft_p99_s"],
        ]
    right.bar(labels, values, color=["grey", "tab:red", "tab:red", "tab:green", "tab:green"])
    right.set(title="TTFT p99 of the quiet stream (s)", yscale="log")
    fig.suptitle(f"{result['model']}, {result['env']['gpu']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    if not 1 <= low <= high:
        raise ValueError(f"expected LOW,HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise ValueError(f"expected some of {','.join(allowed)}, got {text!r}")
        return names

    return parse


def main() -> None:
    parser = engine_parser(__doc__, raw_description=True)
    add_engine_options(parser, max_num_seqs=None, max_model_len=2048)
    parser.add_argument("--prompt-len", type=_pair, default=(100, 1024), help="LOW,HIGH tokens")
    parser.add_argument("--output-len", type=_pair, default=(64, 512), help="LOW,HIGH tokens")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    parser.add_argument("--capacity-requests", type=int, default=512)
    parser.add_argument("--quiet-share", type=float, default=0.5, help="tenant A's rate, as a share of capacity")
    parser.add_argument("--flood-share", type=float, default=2.0, help="tenant B's (and batch's) rate, likewise")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "fairness.png", help="where the plot goes")
    parser.add_argument("--replot", type=Path, default=None, help="only plot a result JSON written before")
    parser.add_argument(
        "--policies", type=_names(POLICIES), default=POLICIES, help="comma-separated, of fcfs,fair (default: both)"
    )
    parser.add_argument(
        "--workloads",
        type=_names(WORKLOADS),
        default=WORKLOADS,
        help="comma-separated, of tenants (A beside B), classes (interactive beside batch); default: both",
    )
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot)
        return

    vocab = load_hf_config(args.config)["vocab_size"]
    capacity = measure_capacity(args, vocab)
    rng = random.Random(args.seed)
    quiet = workload(args, rng, vocab, "A", poisson(rng, args.quiet_share * capacity, args.duration))
    flood = workload(args, rng, vocab, "B", poisson(rng, args.flood_share * capacity, args.duration))
    interactive = [
        Arrival(a.at_s, f"i{a.request_id}", "interactive", "interactive", a.prompt, a.max_tokens) for a in quiet
    ]
    batch = [Arrival(0.0, f"b{a.request_id}", "batch", "batch", a.prompt, a.max_tokens) for a in flood]
    runs = {"A alone": run(args, "fair", quiet, "A")}
    for policy in args.policies:
        if "tenants" in args.workloads:
            runs[f"two tenants, {policy}"] = run(args, policy, quiet + flood, "A")
        if "classes" in args.workloads:
            runs[f"interactive + batch, {policy}"] = run(args, policy, interactive + batch, "interactive")
    described = f"{args.config.name} shape, random weights, {args.dtype}"
    result = {
        "env": environment(),
        "model": described,
        "args": {k: str(v) for k, v in vars(args).items()},
        "capacity_requests_per_s": capacity,
        "runs": runs,
    }
    result["figures"] = figures(runs)
    report(result)
    written = write_json("fairness", result)
    if len(runs) < 1 + len(POLICIES) * len(WORKLOADS):
        print("the plot needs every run: none drawn")
        return
    try:
        plot(result, args.plot)
    except ImportError:  # the GPU machine may lack matplotlib: plot the JSON elsewhere
        print(f"matplotlib is not installed: no plot; run --replot {written} where it is")


if __name__ == "__main__":
    main()
