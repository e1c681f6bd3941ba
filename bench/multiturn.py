"""Multi-turn conversations whose histories outgrow GPU KV memory: turn TTFT with the host KV tier
against GPU-only prefix caching, one fresh engine each, and the same on a workload with no reuse.

    python bench/multiturn.py [--conversations 64] [--turns 10] [--first-len 8192] [--last-len 65536]
                              [--gpu-kv-tokens N] [--host-kv-gib 64] [--plot docs/multiturn.png]
    python bench/multiturn.py --smoke     # the CPU, a tiny model, a few short conversations

Workload (seed 0, random token ids, greedy, ignore_eos): --conversations conversations of --turns
turns; turn t's prompt is the conversation's history, growing linearly from --first-len to
--last-len tokens, each turn adding the previous reply (--output random tokens standing for it, so
the prompts are the same in every run) and the user's new tokens. Turns go round-robin, every
conversation's turn t before any turn t+1, at most --concurrency requests in flight: between two
turns of one conversation every other conversation's history passes through the KV pool, so the
working set (conversations x history) exceeds GPU KV memory (cap it with --gpu-kv-tokens). The
no-reuse workload has the same lengths and order, each prompt starting with tokens of its own, so
no prefix is shared: what the tier costs when it cannot help. A warm-up (not timed) runs first.
TTFT is the engine's arrival-to-first-token time; prefill done by the model, not the gateway.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections import deque
from pathlib import Path

from common import (
    BENCH_DIR,
    ROOT,
    add_engine_options,
    add_kv_cache_dtype_option,
    add_smoke_option,
    dummy_engine,
    engine_parser,
    environment,
    free_device_memory,
    load_hf_config,
    print_table,
    use_smoke_model,
    write_json,
)

GIB = 1 << 30
# (workload, host tier on) of each run, in order.
RUNS = (("reuse", False), ("reuse", True), ("no-reuse", False), ("no-reuse", True))
# TTFT "from turn 3 on": the first two turns of a conversation find nothing of theirs cached.
STEADY_TURN = 3
# --smoke's workload, small enough for the tiny model's 512 positions and a test's seconds.
SMOKE_ARGS = dict(
    conversations=6,
    turns=3,
    first_len=64,
    last_len=256,
    output=2,
    concurrency=2,
    gpu_kv_tokens=512,
    host_kv_gib=64 / 1024,
    max_num_batched_tokens=128,
)


def history_lengths(first: int, last: int, turns: int) -> list[int]:
    """Each turn's prompt length: first to last, evenly."""
    if turns == 1:
        return [last]
    return [first + (last - first) * t // (turns - 1) for t in range(turns)]


class Workload:
    """The prompts of every (conversation, turn): slices of one random token list per conversation
    (one shared history), or, with no reuse, those slices behind two tokens of their own."""

    def __init__(self, args, vocab: int, reuse: bool) -> None:
        rng = random.Random(args.seed)
        self.lengths = history_lengths(args.first_len, args.last_len, args.turns)
        self.tokens = [[rng.randrange(vocab) for _ in range(self.lengths[-1])] for _ in range(args.conversations)]
        self.reuse, self.vocab, self.turns = reuse, vocab, args.turns

    def prompt(self, conversation: int, turn: int) -> list[int]:
        tokens = self.tokens[conversation][: self.lengths[turn]]
        if self.reuse:
            return tokens
        index = conversation * self.turns + turn  # two leading tokens unique to the prompt: no shared prefix
        return [index // self.vocab % self.vocab, index % self.vocab, *tokens[2:]]


def build_engine(args, host_tier: bool):
    from gpuworker.engine.sizing import kv_cache_block_bytes
    from gpuworker.models.loader import load_model_config

    block_size = 16
    gpu_blocks = -(-args.gpu_kv_tokens // block_size) if args.gpu_kv_tokens else None
    host_bytes = int(args.host_kv_gib * GIB) if host_tier else 0
    if host_tier:  # at least one block, however small the budget asked for
        element_size = 1 if args.kv_cache_dtype == "fp8" else (4 if args.dtype == "float32" else 2)
        block = kv_cache_block_bytes(load_model_config(str(args.config)), block_size, element_size)
        host_bytes = max(host_bytes, block)
    return dummy_engine(
        args,
        block_size=block_size,
        num_kv_blocks=gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        host_kv_cache_bytes=host_bytes,
    )


def run(args, workload: Workload, host_tier: bool) -> dict:
    """Every turn of every conversation through a fresh engine; TTFT per turn and the cache counters."""
    from gpuworker.engine import SamplingParams

    engine = build_engine(args, host_tier)
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    # Warm-up, not timed: tokens no prompt of the workload starts with.
    engine.generate([[(7 * i + 3) % workload.vocab for i in range(args.first_len // 2)]], params)
    warm = engine.serving_figures()
    order = deque((c, t) for t in range(args.turns) for c in range(args.conversations))
    ttft: dict[str, float] = {}
    turn_of: dict[str, int] = {}
    started = time.perf_counter()
    in_flight = 0
    while order or engine.has_unfinished_requests():
        while order and in_flight < args.concurrency:
            conversation, turn = order.popleft()
            request_id = f"c{conversation}-t{turn}"
            engine.add_request(request_id, workload.prompt(conversation, turn), params)
            turn_of[request_id] = turn
            in_flight += 1
        for out in engine.step():
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = out.metrics.first_token_time - out.metrics.arrival_time
            in_flight -= out.finished
    seconds = time.perf_counter() - started
    figures = engine.serving_figures()
    tier = engine.scheduler.block_manager.host_tier
    per_turn = [sorted(v for r, v in ttft.items() if turn_of[r] == t) for t in range(args.turns)]
    steady = sorted(v for r, v in ttft.items() if turn_of[r] >= STEADY_TURN - 1)
    queries = figures["prefix_cache_queries"] - warm["prefix_cache_queries"]
    result = {
        "host_tier": host_tier,
        "gpu_kv_tokens": engine.config.num_kv_blocks * engine.config.block_size,
        "host_kv_tokens": engine.config.num_host_kv_blocks * engine.config.block_size,
        "ttft_p50_s": _quantile(sorted(ttft.values()), 0.5),
        "ttft_p99_s": _quantile(sorted(ttft.values()), 0.99),
        "steady_ttft_p50_s": _quantile(steady, 0.5),
        "steady_ttft_p99_s": _quantile(steady, 0.99),
        "turn_ttft_p50_s": [_quantile(v, 0.5) for v in per_turn],
        "turn_ttft_p99_s": [_quantile(v, 0.99) for v in per_turn],
        "prefix_hit_rate": (figures["prefix_cache_hits"] - warm["prefix_cache_hits"]) / queries if queries else 0.0,
        "host_hit_rate": (figures["host_cache_hits"] - warm["host_cache_hits"]) / queries if queries else 0.0,
        "blocks_spilled": tier.num_spilled if tier else 0,
        "blocks_restored": tier.num_restored if tier else 0,
        "requests": len(ttft),
        "seconds": seconds,
    }
    del engine
    gc.collect()
    free_device_memory(args.device)
    return result


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if q < 1 else values[-1]


def plot(result: dict, path: Path) -> None:
    """Turn TTFT p50 and p99 by turn, tier on and off, on the reuse workload; the no-reuse runs' p50
    and p99 beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {(r["workload"], r["host_tier"]): r for r in result["runs"]}
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for tier, color in ((False, "tab:blue"), (True, "tab:orange")):
        run_ = runs.get(("reuse", tier))
        if run_ is None:
            continue
        turns = range(1, len(run_["turn_ttft_p50_s"]) + 1)
        label = "host tier" if tier else "GPU only"
        ax.plot(turns, [1e3 * v for v in run_["turn_ttft_p50_s"]], "o-", color=color, label=f"{label} p50")
        ax.plot(turns, [1e3 * v for v in run_["turn_ttft_p99_s"]], "s--", color=color, label=f"{label} p99")
    ax.set(title="Turn TTFT, conversations sharing their history (ms)", xlabel="turn", yscale="log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    labels, values = [], []
    for (workload, tier), run_ in runs.items():
        for q in ("p50", "p99"):
            labels.append(f"{workload}, {'tier' if tier else 'GPU'} {q}")
            values.append(1e3 * run_[f"ttft_{q}_s"])
    bars.bar(range(len(values)), values, color=["tab:blue", "tab:blue", "tab:orange", "tab:orange"] * 2)
    bars.set_xticks(range(len(values)), labels, fontsize=7, rotation=35, ha="right")
    bars.set(title="TTFT over all turns (ms)")
    fig.suptitle(result["model"], fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def report(result: dict) -> None:
    args = result["args"]
    rows = [
        ("model", f"{result['model']}, on {result['env']['gpu']} (commit {result['env']['commit']})"),
        (
            "workload",
            f"{args['conversations']} conversations x {args['turns']} turns, histories {args['first_len']} -> "
            f"{args['last_len']} tokens, {args['output']} out, round-robin, {args['concurrency']} in flight",
        ),
    ]
    for r in result["runs"]:
        rows.append(
            (
                f"{r['workload']}, {'host tier' if r['host_tier'] else 'GPU only'}",
                f"TTFT p50 {_ms(r['ttft_p50_s'])} p99 {_ms(r['ttft_p99_s'])} ms; from turn {STEADY_TURN} "
                f"p50 {_ms(r['steady_ttft_p50_s'])} p99 {_ms(r['steady_ttft_p99_s'])} ms; prefix hits "
                f"{100 * r['prefix_hit_rate']:.0f}% (host tier {100 * r['host_hit_rate']:.0f}%); "
                f"{r['seconds']:.1f} s",
            )
        )
    pairs = {(r["workload"], r["host_tier"]): r for r in result["runs"]}
    for workload, key in (("reuse", "steady_ttft_p50_s"), ("no-reuse", "ttft_p50_s")):
        off, on = pairs.get((workload, False)), pairs.get((workload, True))
        if off and on and off[key] and on[key]:
            rows.append((f"{workload}: GPU only / host tier", f"{off[key] / on[key]:.2f}x ({key})"))
    first = result["runs"][0]
    rows.append(("KV", f"GPU {first['gpu_kv_tokens']} tokens; host tier {result['runs'][1]['host_kv_tokens']} tokens"))
    print_table("multi-turn TTFT: host KV tier against GPU-only prefix caching", rows)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}" if seconds >= 0.1 else f"{1e3 * seconds:.1f}"


def main() -> None:
    parser = engine_parser(__doc__, raw_description=True)
    parser.set_defaults(config=BENCH_DIR / "configs" / "llama-3.1-8b")
    add_engine_options(parser, max_num_seqs=None, max_model_len=0)
    add_kv_cache_dtype_option(parser)
    add_smoke_option(parser)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--first-len", type=int, default=8192, help="the first turn's prompt tokens")
    parser.add_argument("--last-len", type=int, default=65536, help="the last turn's prompt tokens")
    parser.add_argument("--output", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    parser.add_argument("--gpu-kv-tokens", type=int, default=None, help="cap the GPU KV pool (default: memory)")
    parser.add_argument("--host-kv-gib", type=float, default=64.0, help="the host tier's pinned memory")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's choice")
    parser.add_argument("--workloads", default="reuse,no-reuse", help="comma-separated: reuse, no-reuse")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "multiturn.png")
    args = parser.parse_args()
    if args.smoke:
        use_smoke_model(args)
        for name, value in SMOKE_ARGS.items():
            setattr(args, name, value)
    args.max_model_len = args.max_model_len or args.last_len + args.output
    if args.first_len > args.last_len or args.last_len + args.output > args.max_model_len:
        raise SystemExit("--first-len <= --last-len, and --last-len + --output <= --max-model-len, please")
    vocab = load_hf_config(args.config)["vocab_size"]
    wanted = [w for w in args.workloads.split(",") if w]
    runs = []
    for workload, host_tier in RUNS:
        if workload in wanted:
            result = run(args, Workload(args, vocab, reuse=workload == "reuse"), host_tier)
            runs.append({"workload": workload, **result})
    described = "a tiny random model" if args.smoke else f"{args.config.name} shape, random weights"
    result = {
        "env": environment(),
        "model": f"{described}, {args.dtype}, KV {args.kv_cache_dtype}",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": runs,
    }
    report(result)
    write_json("multiturn", result)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:  # the GPU machine may lack matplotlib: plot the JSON elsewhere
            print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
