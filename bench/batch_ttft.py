"""Interactive time to first token with and without a Batch API job filling the replica.

    python bench/batch_ttft.py [--requests 60] [--concurrency 2] [--batch-lines 400] [--max-tokens 8]

Runs, on this machine, one replica of a tiny random Llama (`python -m gpuworker serve`, CPU unless
a GPU is present), the gateway (uvicorn over controlplane.asgi) and a Celery worker, over the
PostgreSQL database of DATABASE_URL (dropped and migrated; default gpuserve_bench_batch) and the
Redis of REDIS_URL (flushed). It streams `--requests` chat completions at `--concurrency` through the
gateway and times each one's first token, first alone, then while a batch of `--batch-lines`
chat requests runs (BATCH_CONCURRENCY lines in flight), and prints both with the batch lines
answered meanwhile. Seeded and warmed up; the numbers are this machine's, printed with its commit.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOKEN = "bench-batch-worker-token"
MODEL = "bench-tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, timeout: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def prepare_database(database_url: str, replica_url: str) -> str:
    """A fresh, migrated database with a tenant (ample credit, high limits), its key, and the model
    whose one ready replica is ours; returns the key."""
    import psycopg

    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from controlplane.accounts.services import api_key_create, tenant_create
    from controlplane.billing.services import credit_grant, plan_create, price_tier_create
    from controlplane.catalog.services import model_create
    from controlplane.fleet.models import Replica, Worker
    from controlplane.fleet.services.deployments import deployment_create

    plan = plan_create(
        name="bench", included_requests_per_month=0, rate_limit_per_minute=1_000_000, max_concurrent_requests=1_000
    )
    tenant = tenant_create(name="bench", plan=plan)
    credit_grant(tenant=tenant, amount=Decimal("1000"))
    tier = price_tier_create(
        name="bench", price_per_request=Decimal("0.002"), reference_price_per_million_tokens=Decimal("0.1")
    )
    model_create(
        public_name=MODEL,
        family="llama",
        kind="chat",
        weights_path="/bench",
        context_length=256,
        parameter_count=1,
        price_tier=tier,
    )
    deployment = deployment_create(model_name=MODEL)
    worker = Worker.objects.create(
        name="bench", queue_name="gpuworker.bench", advertise_host="127.0.0.1", device=Worker.Device.CPU
    )
    Replica.objects.create(deployment=deployment, worker=worker, state=Replica.State.READY, endpoint_url=replica_url)
    return api_key_create(tenant=tenant, name="bench").plaintext


async def interactive(
    base_url: str, key: str, *, requests: int, concurrency: int, max_tokens: int, pause_s: float
) -> list[float]:
    """Each streamed chat's time to its first content token, in seconds; each client pauses
    `pause_s` between its requests (the idle gaps batch work may fill)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)
    ttfts: list[float] = []
    queue = list(range(requests))

    async def one_client() -> None:
        while queue:
            i = queue.pop()
            started = time.perf_counter()
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"interactive {i}"}],
                max_tokens=max_tokens,
                stream=True,
                temperature=0,
            )
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
            ttfts.append(first if first is not None else time.perf_counter() - started)
            await asyncio.sleep(pause_s)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    await client.close()
    return ttfts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def start_batch(base_url: str, key: str, lines: int, max_tokens: int) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    raw = b"".join(
        json.dumps(
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"batch line {i}"}],
                    "max_tokens": max_tokens * 4,
                    "temperature": 0,
                },
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )
    uploaded = client.files.create(file=("bench.jsonl", io.BytesIO(raw)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id


def batch_counts(base_url: str, key: str, batch_id: str):
    import openai

    batch = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0).batches.retrieve(batch_id)
    return batch.status, batch.request_counts.completed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--batch-lines", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--pause-ms", type=int, default=200, help="each interactive client's pause between requests")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpuserve_bench_batch")
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/9")
    os.environ["GPUSERVE_WORKER_TOKEN"] = TOKEN
    import httpx
    import redis
    import torch

    from bench.common import environment
    from tests.gpuworker.checkpoints import make_checkpoint

    torch.manual_seed(0)
    redis.Redis.from_url(os.environ["REDIS_URL"]).flushdb()
    scratch = Path(tempfile.mkdtemp(prefix="batch-ttft-"))
    checkpoint = make_checkpoint(scratch / "ckpt", "llama")
    replica_port, gateway_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "LOG_LEVEL": "WARNING",
        "BATCH_STORAGE_DIR": str(scratch / "files"),
        "GATEWAY_ROUTING_REFRESH_MS": "200",
    }
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "gpuworker", "serve", "--model", str(checkpoint), "--port", str(replica_port)]
            + ["--token", TOKEN, "--served-model-name", MODEL, "--max-model-len", "256", "--log-level", "warning"],
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
    ]
    try:
        replica_url = f"http://127.0.0.1:{replica_port}"
        key = prepare_database(os.environ["DATABASE_URL"], replica_url)
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--port", str(gateway_port)]
                + ["--log-level", "warning", "--no-access-log"],
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        )
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "solo", "-l", "WARNING"]
                + ["--without-gossip", "--without-mingle"],
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        )
        auth = {"Authorization": f"Bearer {TOKEN}"}
        _wait(lambda: httpx.get(f"{replica_url}/health", headers=auth, timeout=2).status_code == 200, 600, "replica")
        base = f"http://127.0.0.1:{gateway_port}"
        _wait(lambda: httpx.get(f"{base}/v1/models", timeout=2).status_code == 401, 60, "gateway")
        measure = dict(
            requests=args.requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            pause_s=args.pause_ms / 1000,
        )
        asyncio.run(interactive(base, key, **{**measure, "requests": 10}))
        alone = asyncio.run(interactive(base, key, **measure))
        batch_id = start_batch(base, key, args.batch_lines, args.max_tokens)
        _wait(lambda: batch_counts(base, key, batch_id)[1] >= 5, 120, "the batch to start")
        before = batch_counts(base, key, batch_id)[1]
        started = time.perf_counter()
        beside = asyncio.run(interactive(base, key, **measure))
        seconds = time.perf_counter() - started
        status, after = batch_counts(base, key, batch_id)
        report(environment(), args, alone, beside, after - before, seconds, status)
    finally:
        for child in reversed(children):
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
                try:
                    child.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)


def report(env: dict, args, alone: list[float], beside: list[float], lines: int, seconds: float, status: str) -> None:
    print(f"# batch_ttft  commit {env['commit']}  gpu {env['gpu']}  torch {env['torch']}  {env['date']}")
    print(
        f"# {args.requests} streamed chats at concurrency {args.concurrency} (each client pausing {args.pause_ms} ms "
        f"between requests), max_tokens {args.max_tokens}; batch lines of max_tokens {4 * args.max_tokens}"
    )
    print("| interactive load | TTFT p50 (ms) | TTFT p99 (ms) | batch lines answered meanwhile |")
    print("|---|---:|---:|---:|")
    print(f"| alone | {1000 * percentile(alone, 0.5):.0f} | {1000 * percentile(alone, 0.99):.0f} | - |")
    print(
        f"| beside a batch ({status}) | {1000 * percentile(beside, 0.5):.0f} | {1000 * percentile(beside, 0.99):.0f} "
        f"| {lines} in {seconds:.1f} s |"
    )
    change = percentile(beside, 0.99) / percentile(alone, 0.99) - 1
    print(f"# TTFT p99 change with the batch running: {100 * change:+.0f}% (target: at most +10%)")


if __name__ == "__main__":
    main()
