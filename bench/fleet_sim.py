"""Fleet simulator (issue 19): a discrete-event simulation of the serving fleet that drives the real
router (controlplane/gateway/replica_choice.py: affinity_key of each request's OpenAI-style body,
prefix affinity, least outstanding) and the real
autoscaler (controlplane/fleet/autoscaling.py: decide, popular) with simulated replicas whose speeds
come from the engine's measured curves (bench/fleet_model.py says which figures).

    python bench/fleet_sim.py                      # the full run: four scenarios, a table, PNGs
    python bench/fleet_sim.py --hours 0.5 --no-plots

Scenarios over one seeded trace: autoscaled with prefix-aware routing; static provisioning for the
peak (each model held all run at the most replicas the autoscaled run used for it) with prefix-aware
routing; the same static fleet with round-robin routing and no affinity; autoscaled with
round-robin.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet_model import KV_CAPACITY_TOKENS, Replica, Request, Trace, TraceShape  # noqa: E402
from controlplane.fleet.autoscaling import AutoscalePolicy, DeploymentSignals, ReplicaLoad, decide, popular  # noqa: E402
from controlplane.gateway.replica_choice import affinity_choice, affinity_key, least_outstanding  # noqa: E402

# The gateway's defaults (controlplane/settings.py: GATEWAY_AFFINITY_PREFIX_CHARS, _MAX_EXTRA).
AFFINITY_PREFIX_CHARS = 512
AFFINITY_MAX_EXTRA = 4

ARRIVE, STEP, READY, COLD_TIMEOUT, TICK, NEXT_CONVERSATION = range(6)


@dataclass(frozen=True)
class FleetParams:
    """The fleet's settings; the autoscaler's are the defaults of controlplane/settings.py (AUTOSCALE_*)."""

    tick_s: float = 10.0  # AUTOSCALE_INTERVAL_SECONDS
    load_staged_s: float = 5.0  # cold start from weights the worker staged (issue 19, item 4's target)
    load_cold_s: float = 50.0  # from a cold disk (49.8 s measured for Llama-3-8B)
    staged_models: int = 10  # the most popular models' weights are staged on the workers
    cold_wait_s: float = 60.0  # GATEWAY_COLD_START_WAIT_SECONDS: a request waits this long for a first replica
    signal_window_s: float = 30.0  # the TTFT/ITL p95 window a replica reports in its heartbeat
    rate_window_s: float = 60.0  # AUTOSCALE_RATE_WINDOW_SECONDS
    popular_window_s: float = 3600.0  # AUTOSCALE_POPULAR_WINDOW_SECONDS
    popular_top_k: int = 3  # AUTOSCALE_POPULAR_TOP_K
    policy: AutoscalePolicy = AutoscalePolicy(
        min_replicas=0,
        max_replicas=16,
        keep_warm=False,
        target_concurrency=8.0,
        target_utilisation=0.7,
        hysteresis=0.2,
        ttft_slo_s=2.0,
        itl_slo_s=0.1,
        kv_cache_high=0.9,
        scale_up_cooldown_s=30.0,
        scale_down_cooldown_s=300.0,
        idle_to_zero_s=900.0,
    )


@dataclass
class Result:
    name: str
    requests: list[Request]
    gpu_hours: float
    timeline: list[tuple[float, int, float]]  # per tick: (time, active replicas, arrivals per s)
    peak_replicas: dict[int, int]
    model_replicas: list[tuple[float, list[int]]]  # per tick: (time, active replicas of each model)
    decisions: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


class Simulation:
    """One scenario: the trace's requests through the router to simulated replicas, and (unless the
    fleet is static) the autoscaler's decision for every model each tick, applied at once."""

    def __init__(
        self, name: str, trace: Trace, params: FleetParams, *, affinity: bool, static: dict[int, int] | None = None
    ):
        self.name, self.trace, self.params, self.affinity, self.static = name, trace, params, affinity, static
        self.events: list = []
        self.seq = itertools.count()
        self.replica_ids = itertools.count(1)
        self.replicas: dict[int, list[Replica]] = defaultdict(list)  # per model, not yet released
        self.all_replicas: list[Replica] = []
        self.cold_queue: dict[int, deque] = defaultdict(deque)
        self.requests: list[Request] = []
        self.arrivals: dict[int, deque] = defaultdict(deque)  # per model: arrival times (rate window)
        self.popular_counts: dict[int, deque] = defaultdict(deque)
        self.last_request_at: dict[int, float] = {}
        self.last_scaled_at: dict[int, float] = {}
        self.round_robin: dict[int, int] = defaultdict(int)
        self.timeline: list[tuple[float, int, float]] = []
        self.peak: dict[int, int] = defaultdict(int)
        self.model_replicas: list[tuple[float, list[int]]] = []
        self.decisions: dict[str, int] = defaultdict(int)
        self._tick_arrivals = 0
        self.staged = set(range(params.staged_models))

    def push(self, at: float, kind: int, payload) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, payload))

    def run(self) -> Result:
        started = time.perf_counter()
        for model in range(self.trace.shape.models):
            self._schedule_conversation(model, 0.0)
            # The autoscaled fleet starts as a running fleet would be at night: one replica a model,
            # each having just served a request.
            self.last_request_at[model] = 0.0
            for _ in range(self.static[model] if self.static is not None else 1):
                self._add_replica(model, 0.0, load_s=0.0)
        self.push(0.0, TICK, None)
        end = self.trace.duration_s
        handlers = {
            ARRIVE: self._arrive,
            STEP: self._step,
            READY: self._ready,
            COLD_TIMEOUT: self._cold_timeout,
            TICK: self._tick,
            NEXT_CONVERSATION: self._next_conversation,
        }
        while self.events:
            at, _, kind, payload = heapq.heappop(self.events)
            if kind == TICK and at > end:
                continue
            handlers[kind](at, payload)
        last = max([end] + [r.finished_at or r.arrival for r in self.requests])
        gpu_s = sum((r.released_at if r.released_at is not None else last) - r.created_at for r in self.all_replicas)
        return Result(
            self.name,
            self.requests,
            gpu_s / 3600,
            self.timeline,
            dict(self.peak),
            self.model_replicas,
            dict(self.decisions),
            time.perf_counter() - started,
        )

    # ---- traffic ----
    def _schedule_conversation(self, model: int, after: float) -> None:
        nxt = self.trace.next_conversation(model, after)
        if nxt is not None:
            self.push(nxt[0], NEXT_CONVERSATION, nxt[1])

    def _next_conversation(self, now: float, conversation) -> None:
        self._schedule_conversation(conversation.model, now)
        self._arrive(now, conversation.request(0, now))

    def _arrive(self, now: float, request: Request) -> None:
        self.requests.append(request)
        model = request.model
        self.arrivals[model].append(now)
        self.popular_counts[model].append(now)
        self.last_request_at[model] = now
        self._tick_arrivals += 1
        if not self._ready_replicas(model):
            request.cold = True
            self.cold_queue[model].append(request)
            self.push(now + self.params.cold_wait_s, COLD_TIMEOUT, request)
            return
        self._route(now, request)

    def _ready_replicas(self, model: int) -> list[Replica]:
        return [r for r in self.replicas[model] if r.state == "ready"]

    def _route(self, now: float, request: Request) -> None:
        candidates = self._ready_replicas(request.model)
        if self.affinity:
            preferred = affinity_choice(affinity_key(request.body, True, AFFINITY_PREFIX_CHARS), candidates)
            index = least_outstanding(
                [r.outstanding for r in candidates], [True] * len(candidates), preferred, AFFINITY_MAX_EXTRA
            )
        else:
            index = self.round_robin[request.model] % len(candidates)
            self.round_robin[request.model] += 1
        replica = candidates[index]
        request.replica_id = replica.replica_id
        replica.advance(now)
        replica.waiting.append(request)
        replica.admit()
        self._reschedule(replica, now)

    def _cold_timeout(self, now: float, request: Request) -> None:
        queue = self.cold_queue[request.model]
        if request.first_token_at is None and request.replica_id is None and request in queue:
            queue.remove(request)
            request.failed = True
            request.finished_at = now

    # ---- replicas ----
    def _reschedule(self, replica: Replica, now: float) -> float:
        """Schedules the replica's next event; returns its current step time."""
        replica.version += 1
        at, step = replica.next_event_at(now)
        if at is not None:
            self.push(at, STEP, (replica, replica.version))
        return step

    def _step(self, now: float, payload) -> None:
        replica, version = payload
        if version != replica.version:
            return
        replica.advance(now)
        window = self.params.signal_window_s
        while replica.prefilling and replica.prefilling[0][1] <= 1e-6:
            request, _ = replica.prefilling.popleft()
            request.first_token_at = now
            replica.sample(replica.ttft_samples, now, request.ttft, window)
            replica.remember(-1, request.conversation.system_tokens)
            if request.output_tokens > 1:
                replica.start_decoding(request)
            else:
                self._finish(replica, request, now)
        while replica.decoding and replica.decoding[0][0] <= replica.progress + 1e-9:
            _, _, request = heapq.heappop(replica.decoding)
            self._finish(replica, request, now)
        replica.admit()
        if replica.state == "draining" and not replica.outstanding:
            self._release(replica, now)
            return
        replica.sample(replica.step_samples, now, self._reschedule(replica, now), window)

    def _finish(self, replica: Replica, request: Request, now: float) -> None:
        request.finished_at = now
        replica.release(request)
        conversation = request.conversation
        conversation.history = request.prompt_tokens + request.output_tokens
        nxt = request.turn + 1
        if nxt < len(conversation.user_tokens):
            at = now + conversation.think_s[nxt]
            if at < self.trace.duration_s:
                self.push(at, ARRIVE, conversation.request(nxt, at))

    def _add_replica(self, model: int, now: float, load_s: float | None = None) -> None:
        if load_s is None:
            load_s = self.params.load_staged_s if model in self.staged else self.params.load_cold_s
        replica = Replica(next(self.replica_ids), model, created_at=now, ready_at=now + load_s, updated_at=now)
        self.replicas[model].append(replica)
        self.all_replicas.append(replica)
        if load_s <= 0:
            replica.state = "ready"
        else:
            self.push(now + load_s, READY, replica)

    def _ready(self, now: float, replica: Replica) -> None:
        if replica.state != "loading":
            return
        replica.state = "ready"
        replica.updated_at = now
        queue = self.cold_queue[replica.model]
        while queue:
            self._route(now, queue.popleft())

    def _release(self, replica: Replica, now: float) -> None:
        replica.state = "released"
        replica.released_at = now
        replica.version += 1
        self.replicas[replica.model].remove(replica)

    def _active(self, model: int) -> list[Replica]:
        return [r for r in self.replicas[model] if r.state in ("loading", "ready")]

    def _scale(self, model: int, desired: int, now: float) -> None:
        active = self._active(model)
        for _ in range(desired - len(active)):
            self._add_replica(model, now)
        surplus = len(active) - desired
        if surplus <= 0:
            return
        # Loading replicas go first (newest first), then the ready ones with the fewest requests.
        order = sorted(active, key=lambda r: (r.state != "loading", r.outstanding, -r.replica_id))
        for replica in order[:surplus]:
            if replica.state == "loading" or not replica.outstanding:
                self._release(replica, now)
            else:
                replica.state = "draining"

    # ---- the autoscaler's beat ----
    def _tick(self, now: float, _) -> None:
        p = self.params
        counts = {}
        for model in range(self.trace.shape.models):
            for window, arrivals in (
                (p.rate_window_s, self.arrivals[model]),
                (p.popular_window_s, self.popular_counts[model]),
            ):
                while arrivals and arrivals[0] <= now - window:
                    arrivals.popleft()
            counts[model] = len(self.popular_counts[model])
        top = popular(counts, p.popular_top_k)
        total = 0
        per_model = []
        for model in range(self.trace.shape.models):
            if self.static is not None:  # a fixed fleet: no decisions, only the count
                self.peak[model] = len(self._active(model))
                total += self.peak[model]
                continue
            ready = self._ready_replicas(model)
            for replica in ready:
                replica.advance(now)
            signals = DeploymentSignals(
                now=now,
                current_replicas=len(self._active(model)),
                loads=tuple(
                    ReplicaLoad(
                        running=r.running,
                        waiting=len(r.waiting),
                        kv_cache_usage=r.kv_used / KV_CAPACITY_TOKENS,
                        ttft_p95_s=r.p95(r.ttft_samples, now, p.signal_window_s),
                        itl_p95_s=r.p95(r.step_samples, now, p.signal_window_s),
                    )
                    for r in ready
                ),
                request_rate_per_s=len(self.arrivals[model]) / p.rate_window_s,
                last_request_at=self.last_request_at.get(model),
                last_scaled_at=self.last_scaled_at.get(model),
                popular=model in top,
                queued_cold_starts=len(self.cold_queue[model]),
            )
            decision = decide(p.policy, signals)
            self.decisions[decision.action] += 1
            if decision.action == "down" and decision.desired == 0:
                self.decisions["to zero"] += 1
            if decision.desired != signals.current_replicas:
                self._scale(model, decision.desired, now)
                self.last_scaled_at[model] = now
            active = len(self._active(model))
            self.peak[model] = max(self.peak[model], active)
            per_model.append(active)
            total += active
        self.timeline.append((now, total, self._tick_arrivals / p.tick_s))
        if per_model:
            self.model_replicas.append((now, per_model))
        self._tick_arrivals = 0
        self.push(now + p.tick_s, TICK, None)


# ---- figures ----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarise(result: Result, top_models: list[int], slo_s: float) -> dict:
    """The figures the report gives for one scenario."""
    served = [r for r in result.requests if r.ttft is not None]
    ttfts = [r.ttft for r in served]
    later_turns = [r.ttft for r in served if r.turn > 0]
    per_model = {}
    for model in top_models:
        values = [r.ttft for r in served if r.model == model]
        p99 = percentile(values, 0.99)
        per_model[model] = {
            "requests": len(values),
            "ttft_p50_s": percentile(values, 0.5),
            "ttft_p99_s": p99,
            "within_slo": p99 is not None and p99 <= slo_s,
        }
    total = len(result.requests)
    return {
        "scenario": result.name,
        "requests": total,
        "served": len(served),
        "failed": sum(r.failed for r in result.requests),
        "unfinished": total - len(served) - sum(r.failed for r in result.requests),
        "cold_starts": sum(r.cold for r in result.requests),
        "cold_start_share": sum(r.cold for r in result.requests) / total if total else 0.0,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "later_turns_ttft_mean_s": sum(later_turns) / len(later_turns) if later_turns else None,
        "gpu_hours": result.gpu_hours,
        "peak_replicas": sum(result.peak_replicas.values()),
        "top_models": per_model,
        "decisions": result.decisions,
        "wall_s": result.wall_s,
    }


SCENARIOS = ("autoscaled", "static-peak", "static-peak-round-robin", "autoscaled-round-robin", "static-daily-peak")


def run_scenarios(
    shape: TraceShape, params: FleetParams, seed: int, duration_s: float, scenarios: tuple[str, ...] = SCENARIOS
) -> list[Result]:
    """Runs the scenarios on the same trace. The static ones hold the autoscaled run's per-model peak:
    over the whole run ("static-peak"), or outside the bursts and the scale-down cooldown after each
    ("static-daily-peak": a fleet sized for the daily cycle that rides out bursts on batching)."""
    trace = Trace(shape, seed, duration_s)
    results = [Simulation("autoscaled", trace, params, affinity=True).run()]
    static = {m: max(1, results[0].peak_replicas.get(m, 0)) for m in range(shape.models)}
    settle_s = shape.burst_s + params.policy.scale_down_cooldown_s + 2 * params.tick_s
    calm = [
        counts for t, counts in results[0].model_replicas if not any(b <= t <= b + settle_s for b in trace.burst_starts)
    ]
    daily = {m: max([1] + [counts[m] for counts in calm]) for m in range(shape.models)}
    others = {
        "static-daily-peak": dict(affinity=True, static=daily),
        "static-peak": dict(affinity=True, static=static),
        "static-peak-round-robin": dict(affinity=False, static=static),
        "autoscaled-round-robin": dict(affinity=False),
    }
    for name in scenarios[1:]:
        results.append(Simulation(name, Trace(shape, seed, duration_s), params, **others[name]).run())
    return results


def plot(results: list[Result], summaries: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(9, 4))
    for result in results:
        if result.name.startswith("autoscaled"):
            ax.step(
                [t / 3600 for t, _, _ in result.timeline],
                [n for _, n, _ in result.timeline],
                where="post",
                label=f"replicas, {result.name}",
            )
    for name, style in (("static-peak", "--"), ("static-daily-peak", ":")):
        static = next((r for r in results if r.name == name), None)
        if static is not None:
            ax.axhline(sum(static.peak_replicas.values()), color="grey", linestyle=style, label=f"replicas, {name}")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("simulated hours")
    ax.set_ylabel("replicas (GPUs)")
    twin = ax.twinx()
    twin.plot(
        [t / 3600 for t, _, _ in results[0].timeline],
        [rate for _, _, rate in results[0].timeline],
        color="tab:red",
        alpha=0.4,
        linewidth=0.8,
        label="requests/s (right)",
    )
    twin.set_ylim(bottom=0)
    twin.set_ylabel("requests per second")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize=8)
    ax.set_title("Replicas over time against the load")
    paths.append(_save(fig, out / "fleet_sim_replicas.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for result in results:
        ttfts = sorted(r.ttft for r in result.requests if r.ttft is not None)
        if ttfts:
            ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=result.name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("TTFT, cumulative")
    paths.append(_save(fig, out / "fleet_sim_ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [s["scenario"] for s in summaries]
    bars = ax.bar(names, [s["gpu_hours"] for s in summaries], color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("GPU-hours")
    ax.set_title("GPU-hours per scenario")
    ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    paths.append(_save(fig, out / "fleet_sim_gpu_hours.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _fmt(value: float | None, unit: str = " s") -> str:
    if value is None:
        return "—"
    return f"{value * 1000:.0f} ms" if unit == " s" and value < 1 else f"{value:.2f}{unit}"


def table(summaries: list[dict], top_models: list[int]) -> str:
    lines = [
        "| scenario | requests | TTFT p50 | TTFT p99 | mean TTFT, later turns | cold starts | failed | "
        "GPU-hours | peak replicas |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['scenario']} | {s['requests']:,} | {_fmt(s['ttft_p50_s'])} | {_fmt(s['ttft_p99_s'])} | "
            f"{_fmt(s['later_turns_ttft_mean_s'])} | {s['cold_starts']} ({s['cold_start_share']:.2%}) | "
            f"{s['failed']} | {s['gpu_hours']:.1f} | {s['peak_replicas']} |"
        )
    lines += [
        "",
        "| scenario | " + " | ".join(f"model {m} p50 / p99" for m in top_models) + " |",
        "|---|" + "---|" * len(top_models),
    ]
    for s in summaries:
        cells = [
            f"{_fmt(v['ttft_p50_s'])} / {_fmt(v['ttft_p99_s'])}{'' if v['within_slo'] else ' ✗'}"
            for v in s["top_models"].values()
        ]
        lines.append(f"| {s['scenario']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hours", type=float, default=4.0, help="simulated time (one compressed day by default)")
    parser.add_argument("--day-hours", type=float, default=4.0, help="length of one daily cycle")
    parser.add_argument("--peak-rps", type=float, default=TraceShape.peak_requests_per_s)
    parser.add_argument("--system-prompt-chars", type=int, default=TraceShape.system_prompt_chars)
    parser.add_argument(
        "--target-concurrency",
        type=float,
        default=FleetParams.policy.target_concurrency,
        help="the deployments' target (AUTOSCALE_TARGET_CONCURRENCY)",
    )
    parser.add_argument("--load-staged-s", type=float, default=FleetParams.load_staged_s)
    parser.add_argument("--load-cold-s", type=float, default=FleetParams.load_cold_s)
    parser.add_argument("--out", type=Path, default=Path("docs/fleet_sim"), help="folder for the PNGs")
    parser.add_argument("--json", type=Path, help="write the summaries here")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated, autoscaled first (the static ones hold its peak)",
    )
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)

    shape = replace(
        TraceShape(),
        peak_requests_per_s=args.peak_rps,
        day_s=args.day_hours * 3600,
        system_prompt_chars=args.system_prompt_chars,
    )
    params = replace(
        FleetParams(),
        load_staged_s=args.load_staged_s,
        load_cold_s=args.load_cold_s,
        policy=replace(FleetParams.policy, target_concurrency=args.target_concurrency),
    )
    duration = args.hours * 3600
    scenarios = tuple(args.scenarios.split(","))
    if scenarios[0] != "autoscaled" or not set(scenarios) <= set(SCENARIOS):
        parser.error(f"--scenarios: autoscaled first, then any of {', '.join(SCENARIOS[1:])}")
    results = run_scenarios(shape, params, args.seed, duration, scenarios)
    trace = Trace(shape, args.seed, duration)
    top = sorted(range(shape.models), key=lambda m: -trace.share[m])[:5]
    summaries = [summarise(r, top, params.policy.ttft_slo_s) for r in results]
    print(
        f"seed {args.seed}, {args.hours} h simulated, day {args.day_hours} h, peak {args.peak_rps} req/s, "
        f"target concurrency {args.target_concurrency}, system prompt {args.system_prompt_chars} chars, "
        f"bursts at {[round(t / 3600, 2) for t in trace.burst_starts]} h"
    )
    print(table(summaries, top))
    by_name = {s["scenario"]: s for s in summaries}
    auto, peak = by_name["autoscaled"], by_name.get("static-peak")
    for name in ("static-peak", "static-daily-peak"):
        if name in by_name:
            print(f"GPU-hours saved against {name}: {1 - auto['gpu_hours'] / by_name[name]['gpu_hours']:.1%}")
    rr = by_name.get("static-peak-round-robin")
    if peak and rr:
        print(
            f"mean TTFT of later turns, round-robin / prefix-aware (static fleet): "
            f"{rr['later_turns_ttft_mean_s'] / peak['later_turns_ttft_mean_s']:.2f}x"
        )
    print("autoscaler decisions:", ", ".join(f"{s['scenario']} {s['decisions']}" for s in summaries if s["decisions"]))
    print("wall:", ", ".join(f"{s['scenario']} {s['wall_s']:.0f} s" for s in summaries))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "params": asdict(params), "summaries": summaries},
                indent=1,
                default=str,
            )
        )
    if not args.no_plots:
        for path in plot(results, summaries, args.out):
            print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
