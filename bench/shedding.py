"""Load shedding by the TTFT objective at a multiple of capacity, beside arrival order (nothing refused)
in the same run: one replica behind the gateway, as in production.

    python bench/shedding.py [--multiple 2] [--duration 30] [--ttft-slo-ms 2000] [--plot docs/shedding.png]
    python bench/shedding.py --smoke                   # CPU, a tiny random model, a few seconds of arrivals

It runs the embedded set-up `make run` uses, so it needs no PostgreSQL and no Redis (DATABASE_URL
and REDIS_URL are ignored): a fresh VAR_DIR holds the SQLite database (migrated, then seeded
through the services: a tenant with ample credit and high limits, its key, the model and its
deployment with --ttft-slo-ms) and the file cache the fleet's heartbeats live in. The replica is
`python -m gpuworker serve` on a random checkpoint of --config's shape (bench/serving.py's
prepare_model); the gateway is uvicorn over controlplane.asgi. In place of the worker daemon, this
process reads the replica's /stats every heartbeat interval and records it through the fleet's
own heartbeat service (parse_heartbeat, then worker_heartbeat), so the gateway's routing table
predicts each replica's wait from the same load report as in production.

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
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    DEFAULT_CONFIG,
    environment,
    free_port,
    load_hf_config,
    start_replica,
    stop_replica,
    wait_ready,
    write_json,
)
from bench.serving import Request, make_requests, percentile, poisson_arrivals, prepare_model  # noqa: E402

MODEL = "bench-shedding"
TOKEN = "bench-shedding-worker-token"
# The deployment's largest objective: nothing is predicted to wait that long, so nothing is shed.
NO_OBJECTIVE_MS = 600_000
CLIENT_START_S = 120.0
STREAM_SILENCE_S = 600.0
SMOKE = {
    "duration": 4.0,
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


# -- the system: the embedded control plane, one replica, its load reports ------------------------


def use_embedded_control_plane(var_dir: Path) -> None:
    """This process and its children on `make run`'s set-up under var_dir: SQLite, the file cache."""
    for name in ("DATABASE_URL", "REDIS_URL"):
        os.environ.pop(name, None)
    os.environ |= {
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "VAR_DIR": str(var_dir),
        "GPUSERVE_WORKER_TOKEN": TOKEN,
        "LOG_LEVEL": "WARNING",
        "BATCH_STORAGE_DIR": str(var_dir / "batch-files"),
    }
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def seed(*, replica_url: str, context_length: int, ttft_slo_ms: int) -> tuple[str, int]:
    """A tenant (ample credit, high limits) and its key, the model, its deployment with the objective,
    and the worker whose ready replica is ours: (the key, the replica's id)."""
    from controlplane.accounts.services import api_key_create, tenant_create
    from controlplane.billing.services import credit_grant, plan_create, price_tier_create
    from controlplane.catalog.services import model_create
    from controlplane.fleet.models import Replica, Worker
    from controlplane.fleet.services.deployments import deployment_create

    plan = plan_create(
        name="bench", included_requests_per_month=0, rate_limit_per_minute=10_000_000, max_concurrent_requests=100_000
    )
    tenant = tenant_create(name="bench", plan=plan)
    credit_grant(tenant=tenant, amount=Decimal("1000000"))
    tier = price_tier_create(
        name="bench", price_per_request=Decimal("0.000001"), reference_price_per_million_tokens=Decimal("0.1")
    )
    model_create(
        public_name=MODEL,
        family="llama",
        kind="completion",
        weights_path="/bench",
        context_length=context_length,
        parameter_count=1,
        price_tier=tier,
    )
    deployment = deployment_create(model_name=MODEL, autoscale=False)
    set_objective(ttft_slo_ms)
    worker = Worker.objects.create(
        name="bench", queue_name="gpuworker.bench", advertise_host="127.0.0.1", device=Worker.Device.CPU
    )
    replica = Replica.objects.create(
        deployment=deployment, worker=worker, state=Replica.State.READY, endpoint_url=replica_url
    )
    return api_key_create(tenant=tenant, name="bench").plaintext, replica.pk


def set_objective(ttft_slo_ms: int) -> None:
    """The deployment's TTFT objective, through the service behind the dashboard's deployment form."""
    from controlplane.catalog.models import Deployment
    from controlplane.fleet.services.deployments import deployment_update

    deployment = Deployment.objects.get(model__public_name=MODEL)
    deployment_update(
        deployment=deployment,
        desired_replicas=deployment.desired_replicas,
        min_replicas=deployment.min_replicas,
        max_replicas=deployment.max_replicas,
        keep_warm=deployment.keep_warm,
        ttft_slo_ms=ttft_slo_ms,
    )


class LoadReports:
    """The worker daemon's heartbeat, for our one replica: its /stats as the daemon reports them
    (supervisor.Replica.report), parsed as the fleet server parses them and recorded by the fleet's
    heartbeat service, every heartbeat interval, in a thread."""

    def __init__(self, replica_id: int, replica_url: str, model_path: str) -> None:
        from django.conf import settings

        from controlplane.fleet.models import Replica

        self.replica_id, self.replica_url, self.model_path = replica_id, replica_url, model_path
        self.worker_id = Replica.objects.get(pk=replica_id).worker_id
        self.interval_s = settings.FLEET_HEARTBEAT_INTERVAL_SECONDS
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="load-reports", daemon=True)

    def __enter__(self) -> LoadReports:
        self.send()  # the first report is in before any request
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()

    def send(self) -> None:
        import httpx
        from django.db import close_old_connections
        from django.utils import timezone

        from controlplane.fleet.services.heartbeats import worker_heartbeat
        from gpuworker.contract.heartbeat import Heartbeat, parse_heartbeat
        from gpuworker.contract.tasks import LoadModel
        from gpuworker.daemon.supervisor import Replica

        auth = {"Authorization": f"Bearer {TOKEN}"}
        stats = httpx.get(f"{self.replica_url}/stats", headers=auth, timeout=5).json()
        load = LoadModel(
            replica_id=self.replica_id,
            model_path=self.model_path,
            served_model_name=MODEL,
            gpu_index=None,
            memory_fraction=0.9,
        )
        report = Replica(request=load, state="ready", endpoint_url=self.replica_url, figures=stats).report()
        sent = Heartbeat(sent_at=timezone.now().isoformat(), draining=False, gpus=(), cpu={}, replicas=(report,))
        close_old_connections()
        worker_heartbeat(worker_id=self.worker_id, heartbeat=parse_heartbeat(sent.to_json()), now=timezone.now())

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.send()


def wait_idle(replica_url: str, deadline_s: float = 600.0) -> None:
    """Until the replica has nothing running or waiting (the previous run's work is done)."""
    import httpx

    auth = {"Authorization": f"Bearer {TOKEN}"}
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        stats = httpx.get(f"{replica_url}/stats", headers=auth, timeout=5).json()
        if not stats.get("running") and not stats.get("waiting"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the replica still had work after {deadline_s:.0f} s")


def start_gateway(port: int, processes: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--workers", str(processes), "--log-level", "warning", "--no-access-log"]
    env = {**os.environ, "LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_gateway(process: subprocess.Popen, url: str, key: str, log: Path, deadline_s: float = 120.0) -> None:
    """Until the gateway lists the model to the key (its routing table has the replica)."""
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}; see {log}")
        try:
            listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2)
            if listed.status_code == 200 and any(m["id"] == MODEL for m in listed.json()["data"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not route {MODEL} within {deadline_s:.0f} s; see {log}")


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
    parser.add_argument("--gateway-processes", type=int, default=2, help="uvicorn --workers")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the replica's (default: serve's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of both runs (e.g. docs/shedding.png)")
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
        set_objective(ttft_slo_ms)
        time.sleep(3 * settings.GATEWAY_ROUTING_REFRESH_MS / 1000)  # the gateway's table refreshes on a timer

    objective(NO_OBJECTIVE_MS)
    measure(args, url, key, replica_url, requests(8, "warmup"))
    saturation = summarise(measure(args, url, key, replica_url, requests(args.saturation_requests, "saturation")))
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
    return {"saturation": saturation, "rate_requests_per_s": rate, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-shedding-"))
    model = prepare_model(args, workdir)
    vocab = load_hf_config(model)["vocab_size"]
    context_length = args.prompt_len[1] + args.output_len[1]
    use_embedded_control_plane(workdir / "var")
    replica_log, gateway_log = workdir / "replica.log", workdir / "gateway.log"
    replica, replica_url = start_replica(
        model,
        device=args.device,
        dtype=args.dtype,
        log=replica_log,
        extra_args=(
            *("--token", TOKEN, "--served-model-name", MODEL, "--max-model-len", str(context_length)),
            *(("--max-num-seqs", str(args.max_num_seqs)) if args.max_num_seqs else ()),
        ),
    )
    gateway = None
    try:
        key, replica_id = seed(replica_url=replica_url, context_length=context_length, ttft_slo_ms=args.ttft_slo_ms)
        port = free_port()
        gateway, url = start_gateway(port, args.gateway_processes, gateway_log), f"http://127.0.0.1:{port}"
        wait_ready(replica, replica_url, replica_log, token=TOKEN)
        with LoadReports(replica_id, replica_url, str(model)):
            wait_gateway(gateway, url, key, gateway_log)
            result = run_all(args, url, key, replica_url, vocab)
    finally:
        if gateway is not None:
            stop_replica(gateway)  # SIGTERM, then SIGKILL past 30 s: the same for any server
        stop_replica(replica)
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
