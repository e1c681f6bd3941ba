"""Serving under load, as clients see it: `python -m gpuworker serve` driven over HTTP, against
offline `LLMEngine.generate` on the same requests, in one run.

    python bench/serving.py [--rates inf,5,10,15,20,25] [--duration 25] [--budget 450] [--plot PNG]
    python bench/serving.py --engine-modes process,in-process       # both engine modes, one run each
    python bench/serving.py --smoke                                  # CPU, a tiny random model
    python bench/serving.py --replot bench/results/serving.json --plot docs/serving.png

Model: random bf16 weights of --config's shape (Llama-3-8B) written once to --checkpoint (skipped
when complete there), served by the replica started as the daemon starts it, with its defaults.

Workload (seed 0), chat-like: prompts of U[100, 1024] random token ids, outputs of U[64, 512]
tokens (greedy, ignore_eos), each a streaming POST /v1/completions with the prompt as token ids (so
lengths are exact) and usage in the last chunk. At a rate r (requests/s) arrivals are Poisson
(exponential gaps of mean 1/r) for --duration seconds; `inf` sends --burst-requests at once. Each
run ends when its last answer does. Rates run in the order given; once the whole run has used
--budget seconds less two durations, the rates left are skipped (and named), so the run ends in time
with the figures it has.

Per rate: TTFT (send to first token), TPOT ((last token - first token) / (output tokens - 1)),
ITL (gaps between streamed chunks), p50 and p99; requests/s and output tok/s over the run (first
send to last answer); goodput, the requests/s that met the SLO (TTFT <= 1 s and TPOT <= 50 ms).
Offline baseline: `LLMEngine.generate` on the burst's requests with serve's engine settings, in a
process of its own before the server starts (each gets the GPU's memory); the burst's output tok/s
against it is the ratio printed.

The load generator is --client-processes processes of asyncio + httpx, the requests dealt to them
round-robin. Each reports its CPU use and how late it sent requests against their schedule: a
client near 100% CPU, or sending late, is the bottleneck instead of the server.

Several GPUs (issue 25): --tensor-parallel-size T serves one replica over T GPUs; --replicas R starts
R replicas on GPUs 0, T, 2T, ... and each client sends every request to the replica with the fewest
requests outstanding (the gateway's rule, controlplane.gateway.replica_choice.least_outstanding,
counted per client process: the gateway counts across its workers). The offline baseline runs one
engine of T ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import multiprocessing
import os
import queue
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    DEFAULT_CONFIG,
    environment,
    load_hf_config,
    print_table,
    start_replica,
    stop_replica,
    wait_ready,
    write_checkpoint,
    write_json,
)


def _load_replica_choice():
    """The gateway's routing rules (controlplane/gateway/replica_choice.py, standard library only),
    loaded from their file: importing the controlplane package imports Celery and Django, which the
    GPU machine does not have."""
    path = ROOT / "controlplane" / "gateway" / "replica_choice.py"
    spec = importlib.util.spec_from_file_location("replica_choice", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


least_outstanding = _load_replica_choice().least_outstanding

SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.050
SERVED_MODEL_NAME = "bench"
# A client process above this share of one core may be what limits the run.
CLIENT_CPU_WARNING = 0.7
# A stream silent this long (no byte, not even before its first token) is failed, not waited on forever.
STREAM_SILENCE_S = 300.0
# Client processes import httpx and connect within this; past it the run stops with the reason.
CLIENT_START_S = 120.0
# Output tokens of each warm-up request: more steps than the replica has decode graphs to capture.
WARMUP_TOKENS = 64


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int
    arrival_s: float  # after the run's start


@dataclass
class Record:
    """One request as its client saw it; times are time.monotonic() (the same clock in every process)."""

    output_len: int
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    replica: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens == self.output_len and bool(self.chunks)


def make_requests(
    count: int, vocab_size: int, seed: int | str, prompt_lens: tuple[int, int], output_lens: tuple[int, int]
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
        for _ in range(count)
    ]


def poisson_arrivals(rate: float, duration_s: float, seed: int | str) -> list[float]:
    rng, t, arrivals = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            return arrivals
        arrivals.append(t)


# -- the load generator (runs in client processes) ---------------------------------------------


async def _send(clients: list, outstanding: list[int], request: Request, start: float) -> Record:

    record = Record(request.output_len)
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
    record.sent = time.monotonic()
    record.replica = least_outstanding(outstanding, [True] * len(outstanding), None, 0)
    outstanding[record.replica] += 1
    try:
        return await _stream(clients[record.replica], request, record)
    finally:
        outstanding[record.replica] -= 1


async def _stream(client, request: Request, record: Record) -> Record:
    import httpx

    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, chunk = time.monotonic(), json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "error")
                elif chunk.get("choices"):
                    record.chunks.append(now)
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def _drive(urls: list[str], requests: list[Request], barrier) -> dict:
    import contextlib

    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # No limit on waiting for a connection of the pool: a request queued behind many is still timed.
    timeout = httpx.Timeout(STREAM_SILENCE_S, pool=None)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits))
            for url in urls
        ]
        outstanding = [0] * len(urls)
        barrier.wait(timeout=CLIENT_START_S)  # every client process starts the schedule together
        start, cpu_started = time.monotonic(), time.process_time()
        records = await asyncio.gather(*(_send(clients, outstanding, r, start) for r in requests))
        wall = time.monotonic() - start
    lags = [r.sent - (start + q.arrival_s) for r, q in zip(records, requests)]
    return {
        "records": [asdict(r) for r in records],
        "cpu_share": (time.process_time() - cpu_started) / wall,
        "lags": lags,
    }


def client_process(urls: list[str], requests: list[Request], barrier, results) -> None:
    try:
        results.put(asyncio.run(_drive(urls, requests, barrier)))
    except BaseException as exc:  # the parent reports it instead of waiting for a result forever
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run_load(urls: list[str], requests: list[Request], processes: int) -> dict:
    """Send `requests` on their schedule from `processes` client processes, each request to the
    replica (of `urls`) with the fewest outstanding: their records and figures."""
    context = multiprocessing.get_context("spawn")
    processes = max(1, min(processes, len(requests)))
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=client_process, args=(urls, requests[k::processes], barrier, results))
        for k in range(processes)
    ]
    for worker in workers:
        worker.start()
    outcomes = []
    try:
        while len(outcomes) < processes:
            try:
                outcome = results.get(timeout=1.0)
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in workers):
                    raise RuntimeError("a client process died") from None
                continue
            if "error" in outcome:
                raise RuntimeError(f"a client process failed: {outcome['error']}")
            outcomes.append(outcome)
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    return {
        "records": [Record(**r) for o in outcomes for r in o["records"]],
        "client_cpu_share": [round(o["cpu_share"], 3) for o in outcomes],
        "send_lags": [lag for o in outcomes for lag in o["lags"]],
    }


# -- figures ------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear between ranks, as numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(load: dict) -> dict:
    records = load["records"]
    done = [r for r in records if r.ok]
    ttft = [r.chunks[0] - r.sent for r in done]
    tpot = [(r.chunks[-1] - r.chunks[0]) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [b - a for r in done for a, b in zip(r.chunks, r.chunks[1:])]
    good = [
        r
        for r in done
        if r.chunks[0] - r.sent <= SLO_TTFT_S
        and (r.output_tokens <= 1 or (r.chunks[-1] - r.chunks[0]) / (r.output_tokens - 1) <= SLO_TPOT_S)
    ]
    elapsed = max(r.chunks[-1] for r in done) - min(r.sent for r in records) if done else float("nan")
    failed = [r for r in records if not r.ok]
    summary = {
        "requests": len(records),
        "failed": len(failed),
        "seconds": round(elapsed, 3),
        "requests_per_s": len(done) / elapsed,
        "output_tok_s": sum(r.output_tokens for r in done) / elapsed,
        "goodput_requests_per_s": len(good) / elapsed,
        "goodput_output_tok_s": sum(r.output_tokens for r in good) / elapsed,
        "slo_attained": len(good) / len(records),
        "client_cpu_share": load["client_cpu_share"],
        "send_lag_p99_s": percentile(load["send_lags"], 99),
        "requests_per_replica": [
            sum(r.replica == i for r in records) for i in range(1 + max((r.replica for r in records), default=0))
        ],
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        summary |= {f"{name}_p50_s": percentile(values, 50), f"{name}_p99_s": percentile(values, 99)}
    if failed:
        summary["first_error"] = failed[0].error or f"{failed[0].output_tokens} of {failed[0].output_len} tokens"
    return summary


# -- the offline baseline (runs in a process of its own) ----------------------------------------


def offline_generate(
    model: str,
    device: str,
    dtype: str,
    requests: list[tuple[list[int], int]],
    warmup: list[tuple[list[int], int]],
    tensor_parallel_size: int = 1,
) -> dict:
    """LLMEngine.generate on `requests` with serve's engine settings (dummy weights: the same speed),
    after `warmup` (other prompts, so that nothing of the timed ones is in the prefix cache)."""
    from gpuworker.engine import LLMEngine, SamplingParams

    engine = LLMEngine(
        model,
        device=device,
        dtype=dtype,
        load_format="dummy",
        gpu_memory_utilization=0.9,
        tensor_parallel_size=tensor_parallel_size,
    )
    warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.generate([p for p, _ in warmup], warm)  # kernels compile outside the timed run
    engine.generate([warmup[0][0]], warm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    started = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], params)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if generated != sum(n for _, n in requests):
        raise RuntimeError(f"offline generate made {generated} tokens, expected {sum(n for _, n in requests)}")
    return {
        "requests": len(requests),
        "seconds": round(seconds, 3),
        "output_tok_s": generated / seconds,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "tensor_parallel_size": tensor_parallel_size,
    }


def in_own_process(function, *args):
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


# -- the run ------------------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        rate = float(part)  # "inf" parses to math.inf: everything at once
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"--rates: each rate must be > 0 requests/s or inf, got {part!r}")
        rates.append(rate)
    return rates


def rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def prepare_model(args, workdir: Path) -> Path:
    if args.smoke:
        from gpuworker.demo_model import write_demo_model

        return write_demo_model(workdir / "tiny", seed=args.seed)
    # In a process of its own: this one keeps no CUDA context, so the offline run and the replica
    # each find the GPU's memory as a worker's replica would.
    in_own_process(write_checkpoint, args.checkpoint, args.config, 4)
    return args.checkpoint


# serve's arguments for each --engine-modes entry.
ENGINE_MODE_ARGS = {"default": (), "process": ("--engine-process",), "in-process": ("--engine-in-process",)}


def replica_device(device: str, first_gpu: int) -> str:
    """The --device of a replica whose ranks start at GPU first_gpu ("cuda" -> "cuda:N"; CPU as is)."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + first_gpu}"


def parse_engine_modes(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [mode for mode in modes if mode not in ENGINE_MODE_ARGS]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(
            f"--engine-modes: each must be one of {', '.join(ENGINE_MODE_ARGS)}, got {text!r}"
        )
    return modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=Path("/root/ckpt-serving"),
        help="where the random checkpoint is (written once)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--rates",
        type=parse_rates,
        default=parse_rates("inf,5,10,15,20,25"),
        help="requests/s, comma-separated, run in this order; inf sends --burst-requests at once",
    )
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of Poisson arrivals per rate")
    parser.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds the whole run may take (checkpoint writing included); rates that would "
        "start too late are skipped",
    )
    parser.add_argument("--burst-requests", type=int, default=512)
    parser.add_argument("--prompt-lens", default="100,1024", help="min,max prompt tokens (uniform)")
    parser.add_argument("--output-lens", default="64,512", help="min,max output tokens (uniform)")
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the figures against rate")
    parser.add_argument("--replot", type=Path, default=None, help="only plot a serving.json written before")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU, a few requests")
    parser.add_argument(
        "--engine-modes",
        type=parse_engine_modes,
        default=("default",),
        help="comma-separated: 'process' (serve --engine-process), 'in-process' (serve "
        "--engine-in-process), 'default' (serve's default for the device); the rates run "
        "against one replica per mode, in the order given",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="replicas served side by side, the requests routed to the least busy"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (or CPU ranks) per replica")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return
    if args.smoke:
        args.device, args.dtype, args.prompt_lens, args.output_lens = "cpu", "float32", "8,32", "4,16"
        args.rates, args.duration, args.burst_requests, args.client_processes = [math.inf, 4.0], 2.0, 6, 2
        args.budget = math.inf

    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    model = prepare_model(args, workdir)
    vocab_size = load_hf_config(model)["vocab_size"]
    prompt_lens = tuple(int(n) for n in args.prompt_lens.split(","))
    output_lens = tuple(int(n) for n in args.output_lens.split(","))
    burst = make_requests(args.burst_requests, vocab_size, args.seed, prompt_lens, output_lens)
    warmup = make_requests(24, vocab_size, f"{args.seed}:warm-up", prompt_lens, output_lens)
    if args.replicas < 1 or args.tensor_parallel_size < 1:
        parser.error("--replicas and --tensor-parallel-size must be at least 1")
    offline = (
        None
        if args.skip_offline
        else in_own_process(
            offline_generate, str(model), args.device, args.dtype, burst, warmup, args.tensor_parallel_size
        )
    )
    if offline:
        print("offline generate", json.dumps(offline), flush=True)

    runs, skipped = [], []
    for mode in args.engine_modes:
        replicas = []
        try:
            for index in range(args.replicas):
                log = Path(os.environ.get("OUT") or ROOT / "bench" / "results") / f"serving_replica_{mode}_{index}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                replicas.append(
                    (
                        *start_replica(
                            model,
                            device=replica_device(args.device, index * args.tensor_parallel_size),
                            dtype=args.dtype,
                            log=log,
                            extra_args=(
                                "--served-model-name",
                                SERVED_MODEL_NAME,
                                "--tensor-parallel-size",
                                str(args.tensor_parallel_size),
                                *ENGINE_MODE_ARGS[mode],
                            ),
                        ),
                        log,
                    )
                )
            for process, url, log in replicas:
                wait_ready(process, url, log)
                # Warm-up, left out: prefill and decode kernels compile now, and the replica's deferred
                # warm-up (one CUDA graph captured per step, EngineConfig.defer_warm_up) ends within its steps.
                run_load([url], [Request(p, WARMUP_TOKENS, 0.0) for p, _ in warmup], 1)
            urls = [url for _, url, _ in replicas]
            for rate in args.rates:
                if time.perf_counter() - started > args.budget - 2 * args.duration:
                    skipped.append(f"{mode} {rate_label(rate)}")
                    continue
                if math.isinf(rate):
                    requests = [Request(p, n, 0.0) for p, n in burst]
                else:
                    seed = f"{args.seed}:{rate:g}"  # a rate's requests do not depend on the other rates asked for
                    arrivals = poisson_arrivals(rate, args.duration, seed)
                    shapes = make_requests(len(arrivals), vocab_size, seed, prompt_lens, output_lens)
                    requests = [Request(p, n, t) for (p, n), t in zip(shapes, arrivals)]
                summary = {
                    "rate": rate_label(rate),
                    "offered_rate": None if math.isinf(rate) else rate,
                    "engine_mode": mode,
                    **summarise(run_load(urls, requests, args.client_processes)),
                }
                runs.append(summary)
                print(json.dumps(summary), flush=True)
        finally:
            for process, _, _ in replicas:
                stop_replica(process)

    env = environment()
    described = "a tiny random model" if args.smoke else f"{args.config.name} shape, random weights"
    described += f", {args.replicas} replica(s) of tensor parallel {args.tensor_parallel_size}"
    result = {
        "env": env,
        "model": f"{described}, {args.dtype}",
        "args": {k: str(v) for k, v in vars(args).items()},
        "offline": offline,
        "runs": runs,
        "skipped": skipped,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
        "total_s": round(time.perf_counter() - started, 1),
    }
    report(result, prompt_lens, output_lens)
    written = write_json("serving", result)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:  # the GPU machine may lack matplotlib: plot the JSON elsewhere
            print(f"matplotlib is not installed: no plot; run --replot {written} --plot {args.plot} where it is")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}" if seconds >= 0.1 else f"{1e3 * seconds:.1f}"


def report(result: dict, prompt_lens: tuple[int, int], output_lens: tuple[int, int]) -> None:
    env, offline, args = result["env"], result["offline"], result["args"]
    rows = [
        ("model", f"{result['model']}, on {env['gpu']} (commit {env['commit']})"),
        (
            "workload",
            f"prompts U{list(prompt_lens)}, outputs U{list(output_lens)} tokens, greedy, ignore_eos, "
            f"seed {args['seed']}; Poisson for {args['duration']} s per rate",
        ),
        ("SLO", f"TTFT <= {SLO_TTFT_S:g} s and TPOT <= {1e3 * SLO_TPOT_S:g} ms"),
    ]
    if offline:
        rows.append(
            (
                "offline generate",
                f"{offline['output_tok_s']:,.0f} output tok/s on the {offline['requests']} "
                f"requests sent at once (max_num_seqs {offline['max_num_seqs']})",
            )
        )
    rows.append(
        (
            "rate: req/s, out tok/s, goodput",
            "TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | failed | client CPU max, send lag p99",
        )
    )
    for run in result["runs"]:
        ratio = (
            f" ({run['output_tok_s'] / offline['output_tok_s']:.2f}x offline)"
            if offline and run["offered_rate"] is None
            else ""
        )
        mode = f"{run['engine_mode']} " if len(set(r.get("engine_mode") for r in result["runs"])) > 1 else ""
        rows.append(
            (
                f"{mode}{run['rate']}: {run['requests_per_s']:.1f}, {run['output_tok_s']:,.0f}{ratio}, "
                f"{run['goodput_requests_per_s']:.1f}",
                f"{_ms(run['ttft_p50_s'])}/{_ms(run['ttft_p99_s'])} | {_ms(run['tpot_p50_s'])}/"
                f"{_ms(run['tpot_p99_s'])} | {_ms(run['itl_p50_s'])}/{_ms(run['itl_p99_s'])} | "
                f"{run['failed']} of {run['requests']} | {100 * max(run['client_cpu_share']):.0f}%, "
                f"{_ms(run['send_lag_p99_s'])} ms",
            )
        )
        if max(run["client_cpu_share"]) > CLIENT_CPU_WARNING:
            rows.append(("  warning", "a client process was busy: use more --client-processes"))
        if run["failed"]:
            rows.append(("  first failure", run["first_error"]))
    if result["skipped"]:
        rows.append(("skipped (out of --budget)", ", ".join(result["skipped"])))
    print_table(f"serving (whole run {result['total_s']:.0f} s)", rows)


def plot(result: dict, path: Path) -> None:
    """TTFT and TPOT p50/p99 and output tok/s against the offered rate (Poisson runs), with the
    burst and offline generate as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One engine mode per plot: the first one run.
    first_mode = result["runs"][0].get("engine_mode") if result["runs"] else None
    plotted = [r for r in result["runs"] if r.get("engine_mode") == first_mode]
    poisson = [r for r in plotted if r["offered_rate"] is not None]
    burst = next((r for r in plotted if r["offered_rate"] is None), None)
    rates = [r["offered_rate"] for r in poisson]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, slo, title in ((axes[0], "ttft", SLO_TTFT_S, "TTFT"), (axes[1], "tpot", SLO_TPOT_S, "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [1e3 * (r[f"{metric}_{q}_s"] or math.nan) for r in poisson], style, label=q)
        ax.axhline(1e3 * slo, color="grey", linestyle=":", label="SLO")
        ax.set(title=f"{title} (ms)", xlabel="offered rate (requests/s)", yscale="log")
        ax.legend()
    ax = axes[2]
    ax.plot(rates, [r["output_tok_s"] for r in poisson], "o-", label="output tok/s")
    ax.plot(rates, [r["goodput_output_tok_s"] for r in poisson], "s--", label="of requests within the SLO")
    if burst:
        ax.axhline(burst["output_tok_s"], color="tab:green", linestyle="-.", label="all at once")
    if result["offline"]:
        ax.axhline(result["offline"]["output_tok_s"], color="black", linestyle=":", label="offline generate")
    ax.set(title="throughput", xlabel="offered rate (requests/s)", ylim=(0, None))
    ax.legend()
    env = result["env"]
    fig.suptitle(f"gpuworker serve: {result['model']}, {env['gpu']}, commit {env['commit']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
