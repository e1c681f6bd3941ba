"""Load shedding by the TTFT objective at a multiple of capacity, beside arrival order (nothing refused)
in the same run: one replica behind the gateway, as in production.

    python bench/shedding.py [--multiple 2] [--duration 30] [--ttft-slo-ms 2000] [--plot docs/shedding.png]
    python bench/shedding.py --smoke                   # CPU, a tiny random model, a few seconds of arrivals

It runs the embedded set-up `make run` uses (bench/embedded.py), so it needs no PostgreSQL and no
Redis (DATABASE_URL and REDIS_URL are ignored): a fresh VAR_DIR holds the SQLite database
(migrated, then seeded through the services: a tenant with ample credit and high limits, its key,
the model and its deployment with --ttft-slo-ms) and the file cache the fleet's heartbeats live in.
The replica is `python -m gpuworker serve` on a random checkpoint of --config's shape (bench/
serving.py's prepare_model); the gateway is uvicorn over controlplane.asgi. In place of the worker
daemon, this process reads the replica's /stats every heartbeat interval and records it through
the fleet's own heartbeat service (parse_heartbeat, then worker_heartbeat), so the gateway's
routing table predicts each replica's wait from the same load report as in production.

Workload (bench/serving.py's, seed 0): prompts of U[--prompt-len] random token ids, outputs of
U[--output-len] tokens (greedy, ignore_eos), each a streaming POST /v1/completions through the
gateway with the tenant's key. Saturation: --saturation-requests sent at once with shedding off;
its output tok/s is the replica's capacity and its requests/s sets the arrival rate, --multiple
times it. Then Poisson arrivals at that rate for --duration seconds, twice: shedding on (the
deployment's objective --ttft-slo-ms) and shedding off (the objective at its maximum, so nothing
is refused: arrival order). Each run ends when its last answer does.

Per run: admitted requests' TTFT (send to first token) p50/p99; goodput, the output tok/s of
admitted requests that finished (first send to last answer); shed requests (429 "overloaded") and
how long each took to be answered (send to the whole refusal), p50/p99/max. The targets: admitted
TTFT p99 within the objective, goodput at least --goodput-share of saturation, every shed answer
under --shed-answer-ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import DEFAULT_CONFIG, environment, load_hf_config, write_json  # noqa: E402
from bench.embedded import NO_OBJECTIVE_MS, embedded_system, set_objective, wait_idle  # noqa: E402
from bench.serving import Request, make_requests, percentile, poisson_arrivals, prepare_model  # noqa: E402

MODEL = "bench-shedding"
CLIENT_START_S = 120.0
STREAM_SILENCE_S = 600.0
SMOKE = {
    # Twice saturation on a CPU: a few hundred requests a second through one gateway process.
    "duration": 2.0,
    "saturation_requests": 24,
    "prompt_len": (16, 64),
    "output_len": (4, 16),
    "ttft_slo_ms": 100,
    # A replica of few sequences, so that requests queue in its engine (where the gateway predicts the
    # wait from) rather than in the CPU's HTTP work.
    "max_num_seqs": 4,
    "client_processes": 1,
    "gateway_processes": 1,
}


@dataclass
class Answer:
    """One request as its client saw it; times are time.monotonic() (one clock in every process)."""

    output_len: int
    sent: float = 0.0
    status: int = 0
    code: str | None = None  # the error code of a refusal
    answered: float = 0.0  # the whole answer (the last byte of the stream, or of the refusal)
    first_token: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def shed(self) -> bool:
        return self.status == 429 and self.code == "overloaded"

    @property
    def finished(self) -> bool:
        return self.status == 200 and self.error is None and self.output_tokens == self.output_len


# -- the load generator (runs in client processes) ---------------------------------------------


async def _send(client, request: Request, start: float) -> Answer:
    import httpx

    answer = Answer(request.output_len)
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
    body = {
        "model": MODEL,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer.sent = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            answer.status = response.status_code
            if response.status_code != 200:
                refusal = await response.aread()
                answer.answered = time.monotonic()
                answer.code = _error_code(refusal)
                answer.error = f"HTTP {response.status_code}: {refusal[:200]!r}"
                return answer
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = chunk["error"].get("message", "error")
                elif chunk.get("choices") and answer.first_token is None:
                    answer.first_token = time.monotonic()
                if chunk.get("usage"):
                    answer.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.answered = time.monotonic()
    return answer


def _error_code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def _drive(url: str, key: str, requests: list[Request], barrier) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(STREAM_SILENCE_S, pool=None)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, headers=headers) as client:
        barrier.wait(timeout=CLIENT_START_S)  # every client process starts the schedule together
        start = time.monotonic()
        answers = await asyncio.gather(*(_send(client, r, start) for r in requests))
    return [asdict(a) for a in answers]


def client_process(url: str, key: str, requests: list[Request], barrier, results) -> None:
    try:
        results.put(asyncio.run(_drive(url, key, requests, barrier)))
    except BaseException as exc:  # the parent reports it instead of waiting for a result forever
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run_load(url: str, key: str, requests: list[Request], processes: int) -> list[Answer]:
    """Send `requests` on their schedule through the gateway at `url` from `processes` client processes."""
    context = multiprocessing.get_context("spawn")
    processes = max(1, min(processes, len(requests)))
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=client_process, args=(url, key, requests[k::processes], barrier, results))
        for k in range(processes)
    ]
    for worker in workers:
        worker.start()
    outcomes: list[list[dict]] = []
    try:
        while len(outcomes) < processes:
            try:
                outcome = results.get(timeout=1.0)
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in workers):
                    raise RuntimeError("a client process died") from None
                continue
            if isinstance(outcome, dict):
                raise RuntimeError(f"a client process failed: {outcome['error']}")
            outcomes.append(outcome)
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    return [Answer(**a) for outcome in outcomes for a in outcome]


# -- figures ------------------------------------------------------------------------------------


def summarise(answers: list[Answer]) -> dict:
    """Admitted requests' TTFT, goodput (finished admitted requests' output tok/s, first send to last
    answer), and the shed requests' answer times."""
    admitted = [a for a in answers if a.status == 200]
    finished = [a for a in admitted if a.finished]
    shed = [a for a in answers if a.shed]
    ttft = [a.first_token - a.sent for a in admitted if a.first_token is not None]
    shed_answer = [a.answered - a.sent for a in shed]
    elapsed = max(a.answered for a in answers) - min(a.sent for a in answers) if answers else float("nan")
    failed = [a for a in answers if not a.finished and not a.shed]
    summary = {
        "requests": len(answers),
        "admitted": len(admitted),
        "finished": len(finished),
        "shed": len(shed),
        "failed": len(failed),
        "seconds": round(elapsed, 3),
        "requests_per_s": len(finished) / elapsed,
        "goodput_output_tok_s": sum(a.output_tokens for a in finished) / elapsed,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "shed_answer_p50_s": percentile(shed_answer, 50),
        "shed_answer_p99_s": percentile(shed_answer, 99),
        "shed_answer_max_s": max(shed_answer, default=None),
        # Every one, for the plot.
        "ttft_s": sorted(round(t, 4) for t in ttft),
        "shed_answer_s": sorted(round(t, 5) for t in shed_answer),
    }
    if failed:
        summary["first_error"] = failed[0].error or f"{failed[0].output_tokens} of {failed[0].output_len} tokens"
    return summary


def targets(run: dict, saturation_tok_s: float, *, slo_s: float, goodput_share: float, shed_answer_s: float) -> dict:
    """Each target's pass (True), fail (False), or None where the run has nothing to judge it by."""
    ttft_p99, shed_max = run["ttft_p99_s"], run["shed_answer_max_s"]
    return {
        "ttft_p99_within_objective": None if ttft_p99 is None else ttft_p99 <= slo_s,
        "goodput_share_of_saturation": run["goodput_output_tok_s"] >= goodput_share * saturation_tok_s,
        "every_shed_answer_in_time": None if shed_max is None else shed_max < shed_answer_s,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.0f}"


def _verdict(passed: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "-"}[passed]


def report(result: dict) -> None:
    env, saturation = result["environment"], result["saturation"]
    print(f"\n# shedding  commit {env['commit']}  gpu {env['gpu']}  torch {env['torch']}  {env['date']}")
    print(
        f"# {result['model']} on {result['device']}; prompts U{list(result['prompt_len'])}, outputs "
        f"U{list(result['output_len'])}; saturation {saturation['requests_per_s']:.2f} req/s, "
        f"{saturation['goodput_output_tok_s']:,.0f} output tok/s; arrivals {result['multiple']:g}x: "
        f"{result['rate_requests_per_s']:.2f} req/s for {result['duration_s']:g} s; objective "
        f"{result['ttft_slo_ms']} ms"
    )
    print(
        "| run | requests | admitted | shed | failed | TTFT p50/p99 (ms) | goodput (tok/s) | of saturation "
        "| shed answer p50/p99/max (ms) | TTFT p99 <= objective | goodput target | shed answers in time |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    for name, run in result["runs"].items():
        met = run["targets"]
        print(
            f"| {name} | {run['requests']} | {run['admitted']} | {run['shed']} | {run['failed']} "
            f"| {_ms(run['ttft_p50_s'])} / {_ms(run['ttft_p99_s'])} | {run['goodput_output_tok_s']:,.0f} "
            f"| {run['goodput_output_tok_s'] / saturation['goodput_output_tok_s']:.0%} "
            f"| {_ms(run['shed_answer_p50_s'])} / {_ms(run['shed_answer_p99_s'])} / {_ms(run['shed_answer_max_s'])} "
            f"| {_verdict(met['ttft_p99_within_objective'])} | {_verdict(met['goodput_share_of_saturation'])} "
            f"| {_verdict(met['every_shed_answer_in_time'])} |"
        )
        if run.get("first_error"):
            print(f"# {name}: first failure: {run['first_error']}")


def plot(result: dict, path: Path) -> None:
    """Admitted requests' TTFT distribution per run against the objective, and goodput against saturation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in result["runs"].items():
        ttft = run["ttft_s"]
        left.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=name)
    left.axvline(result["ttft_slo_ms"] / 1000, color="grey", linestyle="--", label="objective")
    left.set(xscale="log", xlabel="TTFT of admitted requests (s)", ylabel="share of admitted requests")
    left.legend()
    saturation = result["saturation"]["goodput_output_tok_s"]
    names = ["saturation", *result["runs"]]
    values = [saturation, *(run["goodput_output_tok_s"] for run in result["runs"].values())]
    right.bar(names, values, color=["grey", "tab:blue", "tab:orange"][: len(names)])
    right.axhline(result["goodput_share"] * saturation, color="grey", linestyle="--", label="target")
    right.set(ylabel="goodput (output tok/s)")
    right.legend()
    fig.suptitle(
        f"{result['multiple']:g}x saturation ({result['rate_requests_per_s']:.1f} req/s), "
        f"commit {result['environment']['commit']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# -- the run ------------------------------------------------------------------------------------


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    try:
        pair = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (whole numbers), got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return pair


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--checkpoint", type=Path, default=Path("/root/ckpt-serving"), help="written once")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--multiple", type=_positive, default=2.0, help="arrival rate over saturation requests/s")
    parser.add_argument("--duration", type=_positive, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--saturation-requests", type=int, default=400)
    parser.add_argument("--ttft-slo-ms", type=int, default=2000, help="the deployment's TTFT objective")
    parser.add_argument("--goodput-share", type=_positive, default=0.95)
    parser.add_argument("--shed-answer-ms", type=_positive, default=50.0)
    parser.add_argument("--prompt-len", type=_pair, default=(100, 1024))
    parser.add_argument("--output-len", type=_pair, default=(64, 512))
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument(
        "--gateway-processes",
        type=int,
        default=1,
        help="uvicorn --workers; without Redis each process counts only its own routed work, so keep 1",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the replica's (default: serve's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of both runs (e.g. docs/shedding.png)")
    parser.add_argument("--logs", type=Path, default=None, help="the servers' logs' folder (default: temporary)")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny random model, a few seconds (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        for name, value in SMOKE.items():
            if parser.get_default(name) == getattr(args, name):
                setattr(args, name, value)
    if not 1 <= args.ttft_slo_ms < NO_OBJECTIVE_MS:
        parser.error(f"--ttft-slo-ms must lie between 1 and {NO_OBJECTIVE_MS - 1}")
    return args


_T0 = time.monotonic()


def progress(text: str) -> None:
    """A line as each phase ends, so a run stopped at its time limit shows how far it came."""
    print(f"[{time.monotonic() - _T0:6.1f} s] {text}", flush=True)


def _brief(run: dict) -> str:
    return (
        f"{run['requests']} requests in {run['seconds']:.1f} s: {run['admitted']} admitted, {run['shed']} shed, "
        f"{run['failed']} failed; TTFT p99 {_ms(run['ttft_p99_s'])} ms; "
        f"goodput {run['goodput_output_tok_s']:,.0f} tok/s"
    )


def measure(args, url: str, key: str, replica_url: str, requests: list[Request]) -> list[Answer]:
    wait_idle(replica_url)
    return run_load(url, key, requests, args.client_processes)


def run_all(args, url: str, key: str, replica_url: str, vocab: int) -> dict:
    """Warm-up, saturation (shedding off), then the Poisson runs: shedding on, shedding off."""
    from django.conf import settings

    def requests(count: int, seed: str, arrivals: list[float] | None = None) -> list[Request]:
        made = make_requests(count, vocab, f"{args.seed}-{seed}", args.prompt_len, args.output_len)
        return [Request(p, n, arrivals[i] if arrivals else 0.0) for i, (p, n) in enumerate(made)]

    def objective(ttft_slo_ms: int) -> None:
        set_objective(MODEL, ttft_slo_ms)
        time.sleep(3 * settings.GATEWAY_ROUTING_REFRESH_MS / 1000)  # the gateway's table refreshes on a timer

    objective(NO_OBJECTIVE_MS)
    measure(args, url, key, replica_url, requests(8, "warmup"))
    progress("warmed up")
    saturation = summarise(measure(args, url, key, replica_url, requests(args.saturation_requests, "saturation")))
    progress(f"saturation: {_brief(saturation)}; {saturation['requests_per_s']:.2f} requests/s")
    rate = args.multiple * saturation["requests_per_s"]
    arrivals = poisson_arrivals(rate, args.duration, args.seed)
    runs = {}
    for name, ttft_slo_ms in (("shedding on", args.ttft_slo_ms), ("shedding off", NO_OBJECTIVE_MS)):
        objective(ttft_slo_ms)
        run = summarise(measure(args, url, key, replica_url, requests(len(arrivals), "poisson", arrivals)))
        run["targets"] = targets(
            run,
            saturation["goodput_output_tok_s"],
            slo_s=args.ttft_slo_ms / 1000,
            goodput_share=args.goodput_share,
            shed_answer_s=args.shed_answer_ms / 1000,
        )
        runs[name] = run
        progress(f"{name} at {rate:.2f} requests/s: {_brief(run)}")
    return {"saturation": saturation, "rate_requests_per_s": rate, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-shedding-"))
    model = prepare_model(args, workdir)
    progress(f"checkpoint ready: {model}")
    vocab = load_hf_config(model)["vocab_size"]
    system = embedded_system(
        model,
        workdir=workdir,
        served_model=MODEL,
        kind="completion",
        device=args.device,
        dtype=args.dtype,
        context_length=args.prompt_len[1] + args.output_len[1],
        ttft_slo_ms=args.ttft_slo_ms,
        replica_args=("--max-num-seqs", str(args.max_num_seqs)) if args.max_num_seqs else (),
        gateway_processes=args.gateway_processes,
        logs=args.logs,
    )
    with system as running:
        progress(f"replica and gateway ready; their logs in {args.logs or workdir}")
        result = run_all(args, running.url, running.key, running.replica_url, vocab)
    result |= {
        "environment": environment(),
        "model": str(args.config) if not args.smoke else "tiny random Llama (smoke)",
        "device": args.device,
        "multiple": args.multiple,
        "duration_s": args.duration,
        "ttft_slo_ms": args.ttft_slo_ms,
        "goodput_share": args.goodput_share,
        "shed_answer_ms": args.shed_answer_ms,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "gateway_processes": args.gateway_processes,
    }
    report(result)
    write_json("shedding", result)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
