"""Gateway stall: requests of 4 MB of token ids, eight at once, through the gateway, while another
tenant streams and a GPU worker daemon heartbeats. Can one tenant starve the control path?

    python bench/gateway_stall.py [--code PATH] [--attackers 8] [--rounds 1] [--lost-after 3]

Runs the system from `--code` (a checkout whose control plane and gpuworker every process imports;
default: this one) over a PostgreSQL and a Redis of its own (tests/private_services.py): the web
server (uvicorn: the dashboard and the /v1 gateway), the fleet server (controlplane.fleet_asgi,
where the checkout has one: the daemon calls it; without one the daemon calls the web server, as
it used to), a Celery worker with beat, and one worker daemon on CPU serving one replica of the
demo model (context 2048). The attacker's key has the demo plan's limits (60 requests a minute, 16
at once). Once another tenant's stream has run for 20 chunks, each attacker sends its 4 MB body
(`--rounds` times in a row); every one is refused (400) somewhere. Printed: the attack's answers and
time, the stream's gaps between chunks meanwhile (max and median; target: max <= 100 ms), the
gaps between the worker's heartbeats as the control plane recorded them (it is judged lost after
FLEET_WORKER_LOST_AFTER_SECONDS = `--lost-after` of silence), and whether the worker stayed online
and its replica up; for comparison, the stream's gaps over `--quiet` seconds before the attack (the
machine's own noise), those of a second stream read from the replica itself, past the gateway (what
the replica does on a shared CPU), and the round trips of GET /v1/models sent meanwhile (the web
server's own latency). One 4 MB request before the measurement warms the gateway up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.private_services import PrivatePostgres, PrivateRedis, free_port  # noqa: E402

MODEL = "stall-tiny"
CONTEXT = 2048
TOKEN_IDS = 2_000_000  # 4 MB as JSON: within the gateway's 4 MiB body limit


def attack_body() -> bytes:
    return json.dumps({"model": MODEL, "prompt": [1] * TOKEN_IDS}, separators=(",", ":")).encode()


class System:
    """The system's processes over private services, from one checkout."""

    def __init__(self, code: Path, scratch: Path, lost_after_s: int):
        self.code, self.scratch = code, scratch
        self.postgres, self.redis = PrivatePostgres(), PrivateRedis(scratch)
        self.web_url = f"http://127.0.0.1:{free_port()}"
        self.has_fleet_server = (code / "controlplane" / "fleet_asgi.py").exists()
        self.fleet_url = f"http://127.0.0.1:{free_port()}" if self.has_fleet_server else self.web_url
        self.token = secrets.token_urlsafe(24)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(code),
            "DEBUG": "1",
            "LOG_LEVEL": "WARNING",
            "GPUSERVE_WORKER_TOKEN": self.token,
            "VAR_DIR": str(scratch / "var"),
            "FLEET_WORKER_LOST_AFTER_SECONDS": str(lost_after_s),
            "OMP_NUM_THREADS": "1",
            "GPUSERVE_MODEL_ROOTS": str(scratch / "models"),
            # The model's own body limit (its context times this) up to the global cap, so the attack's
            # 4 MB bodies are parsed in full as they were before limits followed the context.
            "GATEWAY_REQUEST_BYTES_PER_TOKEN": str((4 << 20) // CONTEXT),
        }
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        self.postgres.start()
        self.postgres.create_database()
        self.redis.start()
        self.env.update(DATABASE_URL=self.postgres.url, REDIS_URL=self.redis.url)
        os.environ.update(
            {
                k: self.env[k]
                for k in ("DATABASE_URL", "REDIS_URL", "GPUSERVE_WORKER_TOKEN", "VAR_DIR", "DEBUG", "LOG_LEVEL")
            },
            DJANGO_SETTINGS_MODULE="controlplane.settings",
        )
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)

    def run(self, name: str, *argv: str) -> None:
        log = open(self.scratch / f"{name}.log", "wb")
        self.processes[name] = subprocess.Popen(
            [sys.executable, *argv],
            cwd=self.code,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_processes(self) -> None:
        # uvicorn's lifespan is left at its default (auto), as `make run` runs it: a checkout whose
        # app answers lifespan events (every one with the /v1 gateway) starts its gateway at
        # startup, or lazily where its handler only closes it; one whose app did not answer them
        # would still serve, where `--lifespan on` would refuse to start.
        def server(app: str, url: str) -> list[str]:
            return ["-m", "uvicorn", app, "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], "--no-access-log"]

        self.run("web", *server("controlplane.asgi:application", self.web_url))
        if self.has_fleet_server:
            self.run("fleet", *server("controlplane.fleet_asgi:application", self.fleet_url))
        self.run(
            "celery",
            "-m",
            "celery",
            "-A",
            "controlplane",
            "worker",
            "--beat",
            "-l",
            "WARNING",
            "-c",
            "2",
            "--without-gossip",
            "--without-mingle",
        )
        self.run(
            "daemon",
            "-m",
            "gpuworker",
            "daemon",
            "--control-url",
            self.fleet_url,
            "--name",
            "stall-a",
            "--device",
            "cpu",
            "--advertise-host",
            "127.0.0.1",
            "--state-dir",
            str(self.scratch / "daemon"),
            "--drain-timeout",
            "5",
        )

    def wait(self, check, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise SystemExit(f"{name} exited with {process.returncode}:\n{self.logs()}")
            if value := check():
                return value
            time.sleep(0.2)
        raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"----- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.scratch.glob("*.log"))
        )

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, 9)  # whatever it forked: Celery's pool, the replica, the parsers
            except ProcessLookupError:
                pass
        self.redis.stop()
        self.postgres.remove()


def seed(system: System) -> dict:
    from controlplane.accounts.services import api_key_create, tenant_create
    from controlplane.billing.services import credit_grant, plan_create, price_tier_create
    from controlplane.catalog.services import model_create
    from controlplane.fleet.services.deployments import deployment_create
    from gpuworker.demo_model import write_demo_model

    checkpoint = write_demo_model(system.scratch / "models" / MODEL, max_position_embeddings=CONTEXT)
    tier = price_tier_create(
        name="stall", price_per_request=Decimal("0.002"), reference_price_per_million_tokens=Decimal("0.5")
    )
    model_create(
        public_name=MODEL,
        family="llama",
        kind="chat",
        weights_path=str(checkpoint),
        context_length=CONTEXT,
        parameter_count=4_000_000,
        price_tier=tier,
    )
    deployment = deployment_create(model_name=MODEL, desired_replicas=1, max_replicas=1, autoscale=False)
    keys = {}
    for name, rpm, concurrent in (("attacker", 60, 16), ("other", 100_000, 64)):  # the demo plan's limits
        tenant = tenant_create(
            name=name,
            plan=plan_create(
                name=name, included_requests_per_month=0, rate_limit_per_minute=rpm, max_concurrent_requests=concurrent
            ),
        )
        credit_grant(tenant=tenant, amount=Decimal("100"), memo="stall bench")
        keys[name] = api_key_create(tenant=tenant, name=name).plaintext
    return {"deployment": deployment, "keys": keys}


class HeartbeatWatch(threading.Thread):
    """Each heartbeat of the worker as the control plane stored it (its receipt time, epoch s)."""

    def __init__(self, worker_id: int):
        super().__init__(daemon=True)
        self.worker_id, self.received = worker_id, []
        self.halt = threading.Event()

    def run(self) -> None:
        from controlplane.fleet import heartbeat_cache

        while not self.halt.wait(0.02):
            received = (heartbeat_cache.read(worker_id=self.worker_id) or {}).get("received_at")
            if received and received not in self.received[-1:]:
                self.received.append(received)


def _attackers(url: str, key: str, body: bytes, attackers: int, rounds: int, go, answers) -> None:
    """The attack, in a process of its own so that the client's work does not delay the measuring
    one: `attackers` threads each send `body` `rounds` times once `go` is set; `answers` gets a
    Counter of the answers."""
    counted: Counter = Counter()

    def attack() -> None:
        with httpx.Client(
            timeout=600, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        ) as client:
            for _ in range(rounds):
                try:
                    response = client.post(f"{url}/v1/completions", content=body)
                    counted[f"{response.status_code} {(response.json().get('error') or {}).get('code', '')}"] += 1
                except httpx.HTTPError as exc:
                    counted[type(exc).__name__] += 1

    threads = [threading.Thread(target=attack) for _ in range(attackers)]
    go.wait()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answers.put(counted)


def _gaps(arrivals: list[float], start: float, end: float) -> list[float]:
    """The gaps between a stream's chunks that began within [start, end] (seconds)."""
    times = [t for t in arrivals if t >= start]
    return [b - a for a, b in zip(times, times[1:]) if a <= end]


async def measure(
    system: System, keys: dict, body: bytes, attackers: int, rounds: int, quiet_s: float, replica_url: str
) -> dict:
    arrivals: list[float] = []
    direct: list[float] = []  # a stream from the replica itself, past the gateway: what the replica alone does
    window: dict[str, float] = {}
    spawn = multiprocessing.get_context("spawn")
    go, answered = spawn.Event(), spawn.Queue()
    attacking = spawn.Process(
        target=_attackers, args=(system.web_url, keys["attacker"], body, attackers, rounds, go, answered)
    )
    attacking.start()
    probes: list[float] = []  # GET /v1/models round trips during the attack: the web server's own latency

    async with httpx.AsyncClient(
        base_url=system.web_url, timeout=600, headers={"Authorization": f"Bearer {keys['other']}"}
    ) as client:
        started = asyncio.Event()

        async def stream() -> None:
            async with client.stream(
                "POST",
                "/v1/completions",
                json={"model": MODEL, "prompt": "go", "max_tokens": CONTEXT - 8, "stream": True, "ignore_eos": True},
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.time())
                        if len(arrivals) == 20:
                            started.set()

        async def stream_direct() -> None:
            async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {system.token}"}) as replica:
                async with replica.stream(
                    "POST",
                    f"{replica_url}/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": "go",
                        "max_tokens": CONTEXT - 8,
                        "stream": True,
                        "ignore_eos": True,
                    },
                ) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            direct.append(time.time())

        async def probe() -> None:
            while "end" not in window:
                sent = time.perf_counter()
                await client.get("/v1/models")
                probes.append(time.perf_counter() - sent)
                await asyncio.sleep(0.05)

        streamers = [asyncio.create_task(stream()), asyncio.create_task(stream_direct())]
        await started.wait()
        window["quiet"] = time.time()  # the same stream with nothing else sent: the machine's own noise
        await asyncio.sleep(quiet_s)
        window["start"] = time.time()
        go.set()
        prober = asyncio.create_task(probe())
        answers = await asyncio.to_thread(answered.get)
        window["end"] = time.time()
        attacking.join()
        await prober
        await asyncio.sleep(0.3)  # the gap that spans the end of the window is counted too
        for streamer in streamers:
            streamer.cancel()
        await asyncio.gather(*streamers, return_exceptions=True)
    gaps, quiet = _gaps(arrivals, window["start"], window["end"]), _gaps(arrivals, window["quiet"], window["start"])
    direct_gaps = _gaps(direct, window["start"], window["end"])
    return {
        "window": window,
        "answers": answers,
        "chunks": len([t for t in arrivals if window["start"] <= t <= window["end"]]),
        "stream_ended_in_window": bool(arrivals) and arrivals[-1] < window["end"],
        "max_gap_ms": max(gaps, default=float("inf")) * 1000,
        "p50_gap_ms": statistics.median(gaps) * 1000 if gaps else float("inf"),
        "quiet_max_gap_ms": max(quiet, default=float("inf")) * 1000,
        "quiet_p50_gap_ms": statistics.median(quiet) * 1000 if quiet else float("inf"),
        "direct_max_gap_ms": max(direct_gaps, default=float("inf")) * 1000,
        "direct_p50_gap_ms": statistics.median(direct_gaps) * 1000 if direct_gaps else float("inf"),
        "probe_max_ms": max(probes, default=float("inf")) * 1000,
        "probe_p50_ms": statistics.median(probes) * 1000 if probes else float("inf"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", type=Path, default=REPO, help="the checkout to run the system from")
    parser.add_argument("--attackers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="requests each attacker sends, one after another")
    parser.add_argument("--lost-after", type=int, default=3, help="FLEET_WORKER_LOST_AFTER_SECONDS")
    parser.add_argument("--quiet", type=float, default=3.0, help="seconds of the stream measured before the attack")
    args = parser.parse_args(argv)
    code = args.code.resolve()
    with tempfile.TemporaryDirectory(prefix="gateway-stall-") as tmp:
        system = System(code, Path(tmp), args.lost_after)
        try:
            system.start()
            seeded = seed(system)
            system.start_processes()
            from controlplane.fleet.models import Replica, Worker

            replica = system.wait(
                lambda: Replica.objects.filter(deployment=seeded["deployment"], state=Replica.State.READY).first(),
                600,
                "the replica to be ready",
            )
            worker = Worker.objects.get(pk=replica.worker_id)
            body = attack_body()
            warm = httpx.post(
                f"{system.web_url}/v1/completions",
                content=body,
                timeout=600,
                headers={"Authorization": f"Bearer {seeded['keys']['attacker']}", "Content-Type": "application/json"},
            )
            watch = HeartbeatWatch(worker.pk)
            watch.start()
            result = asyncio.run(
                measure(
                    system,
                    seeded["keys"],
                    body,
                    args.attackers,
                    args.rounds,
                    args.quiet,
                    replica.endpoint_url.rstrip("/"),
                )
            )
            time.sleep(args.lost_after + 2)  # a worker judged lost at the end of the window is seen too
            watch.halt.set()
            watch.join()
            start, end = result["window"]["start"], result["window"]["end"]
            around = (
                [t for t in watch.received if t < start][-1:]
                + [t for t in watch.received if start <= t <= end]
                + [t for t in watch.received if t > end][:1]
            )
            beats = [b - a for a, b in zip(around, around[1:])]
            worker_after = Worker.objects.get(pk=worker.pk)
            replicas_after = list(Replica.objects.filter(deployment=seeded["deployment"]).values_list("pk", "state"))
        finally:
            system.stop()
    lost = worker_after.state_changed_at != worker.state_changed_at
    print(
        f"\ncode: {code}  cores: {os.cpu_count()}  python {sys.version.split()[0]}  "
        f"daemon calls: {'the fleet server' if system.has_fleet_server else 'the web server'}"
    )
    print(f"warm-up request: {warm.status_code}")
    print(
        f"attack: {args.attackers} x {args.rounds} x {len(body) / 1e6:.1f} MB of token ids in "
        f"{end - start:.2f} s; answers: {dict(result['answers'])}"
    )
    print(
        f"other tenant's stream while it ran: {result['chunks']} chunks, max gap {result['max_gap_ms']:.1f} ms, "
        f"median {result['p50_gap_ms']:.1f} ms"
        + (" (the stream ended in the window)" if result["stream_ended_in_window"] else "")
    )
    print(
        f"  the same stream for {args.quiet:g} s before the attack: max gap {result['quiet_max_gap_ms']:.1f} ms, "
        f"median {result['quiet_p50_gap_ms']:.1f} ms"
    )
    print(
        f"  a stream from the replica itself, past the gateway, meanwhile: max gap "
        f"{result['direct_max_gap_ms']:.1f} ms, median {result['direct_p50_gap_ms']:.1f} ms"
    )
    print(
        f"GET /v1/models (other tenant) while it ran: max {result['probe_max_ms']:.1f} ms, "
        f"median {result['probe_p50_ms']:.1f} ms"
    )
    print(
        f"heartbeats recorded around it: {len(around)}, gaps (s): {[round(b, 2) for b in beats]}, "
        f"max {max(beats, default=float('inf')):.2f} s (lost after {args.lost_after} s)"
    )
    print(
        f"worker: {worker_after.state}{' (its state changed: judged lost and back)' if lost else ', never lost'}; "
        f"replicas: before [({replica.pk}, 'ready')], after {replicas_after}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
