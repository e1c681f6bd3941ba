"""Gateway overhead: the latency the /v1 gateway adds in front of a replica, and its requests/s.

    python bench/gateway.py [--processes 1] [--concurrency 32] [--seconds 10]

A stub upstream on loopback answers like a replica (a fixed chat completion, or a stream of
chunks with usage) at almost no cost, so what is measured is the gateway: key check, rate limits
and in-flight accounting in Redis, credit hold and settlement in PostgreSQL (batched), routing,
the relay. Latency: one client, the same requests sent straight to the stub and through the
gateway, alternately, `--repeats` times; the difference of the medians (and of the 99th
percentiles) of the median run is the added latency.
Throughput: `--concurrency` clients for `--seconds`. The load generator is a minimal keep-alive
HTTP/1.1 client on uvloop, and it shares the machine's cores with the gateway and the stub.

Needs PostgreSQL and Redis: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/gpuserve_bench,
created and migrated if missing) and REDIS_URL (default redis://127.0.0.1:6379/9, flushed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-worker-token"
CHAT = {"model": "bench-model", "messages": [{"role": "user", "content": "Say hello in five words."}], "max_tokens": 16}
STREAM_CHUNKS = 16


# --- the stub upstream ----------------------------------------------------------------------


def stub_app():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    usage = {
        "prompt_tokens": 12,
        "completion_tokens": STREAM_CHUNKS,
        "total_tokens": 12 + STREAM_CHUNKS,
        "gpu_time_s": 0.001,
    }
    whole = json.dumps(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": 0,
            "model": "bench-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello there, how are you?"},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }
    ).encode()

    def chunk(choices, **extra) -> bytes:
        body = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "bench-model",
            "choices": choices,
            **extra,
        }
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    events = [
        chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
    ]
    events += [
        chunk([{"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": None}])
        for _ in range(STREAM_CHUNKS - 1)
    ]
    events += [
        chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]),
        chunk([], usage=usage),
        b"data: [DONE]\n\n",
    ]

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        if body.get("stream"):

            async def stream():
                for event in events:
                    yield event

            return StreamingResponse(stream(), media_type="text/event-stream")
        return Response(whole, media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


# --- the load generator ---------------------------------------------------------------------


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return int(lines[0].split()[1]), await reader.readexactly(int(headers["content-length"]))
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return int(lines[0].split()[1]), b"".join(parts)
        parts.append(data[:-2])


def _request(port: int, api_key: str, stream: bool) -> bytes:
    body = json.dumps({**CHAT, "stream": stream}).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {api_key}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def load(
    port: int, api_key: str, *, stream: bool, concurrency: int, count: int = 0, seconds: float = 0.0, warmup: int = 50
) -> dict:
    """`count` requests per client, or as many as fit in `seconds`; latencies of each in seconds."""
    message = _request(port, api_key, stream)
    latencies: list[float] = []
    failures: list[str] = []

    async def client(measure: bool, n: int, until: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        done = 0
        while (done < n) if n else (time.perf_counter() < until):
            started = time.perf_counter()
            writer.write(message)
            status, body = await _read_response(reader)
            if status != 200 or (stream and not body.rstrip().endswith(b"[DONE]")):
                failures.append(f"{status}: {body[:200]!r}")
            elif measure:
                latencies.append(time.perf_counter() - started)
            done += 1
        writer.close()

    await client(False, warmup, 0)
    started = time.perf_counter()
    await asyncio.gather(*[client(True, count, started + seconds) for _ in range(concurrency)])
    wall = time.perf_counter() - started
    if failures:
        raise SystemExit(f"{len(failures)} request(s) failed, e.g. {failures[0]}")
    latencies.sort()
    return {
        "requests": len(latencies),
        "wall_s": wall,
        "requests_per_s": len(latencies) / wall,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
    }


# --- set-up ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(port: int, path: str, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"nothing answered on port {port}")


def prepare_database(database_url: str, stub_port: int) -> str:
    """A fresh, migrated database with a tenant (ample credit, high limits), its key, and a model
    whose one ready replica is the stub; returns the key."""
    import psycopg

    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from bench.embedded import seed

    key, _ = seed(model=CHAT["model"], kind="chat", replica_url=f"http://127.0.0.1:{stub_port}", context_length=4096)
    return key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=1, help="gateway processes (uvicorn --workers)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--latency-requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="latency runs; the median is reported")
    parser.add_argument("--stub", action="store_true", help=argparse.SUPPRESS)  # serve the stub (child)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stub:
        import uvicorn

        uvicorn.run(stub_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
        return

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpuserve_bench")
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/9")
    os.environ.setdefault("GPUSERVE_WORKER_TOKEN", TOKEN)
    sys.path.insert(0, str(REPO))
    import redis
    import uvloop

    load_average = os.getloadavg()
    redis.Redis.from_url(os.environ["REDIS_URL"]).flushdb()
    stub_port, gateway_port = _free_port(), _free_port()
    children = [subprocess.Popen([sys.executable, __file__, "--stub", "--port", str(stub_port)], cwd=REPO)]
    try:
        api_key = prepare_database(os.environ["DATABASE_URL"], stub_port)
        env = {**os.environ, "LOG_LEVEL": "WARNING", "DEBUG": "0", "SECRET_KEY": "bench", "SECURE_SSL_REDIRECT": "0"}
        children.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "controlplane.asgi:application",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(gateway_port),
                    "--workers",
                    str(args.processes),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                    "--loop",
                    "uvloop",
                    "--http",
                    "httptools",
                ],
                cwd=REPO,
                env=env,
            )
        )
        _wait_http(stub_port, "/")
        _wait_http(gateway_port, "/v1/models")
        results = uvloop.run(_measure(args, stub_port, gateway_port, api_key, children[1].pid))
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait(timeout=30)
    _report(args, results, load_average)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of the gateway (uvicorn and any worker processes it forked)."""
    import psutil

    process = psutil.Process(pid)
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        times = p.cpu_times()
        total += times.user + times.system
    return total


async def _measure(args, stub_port: int, gateway_port: int, api_key: str, gateway_pid: int) -> dict:
    """Latency runs also record the gateway's CPU time per request: unlike latency on a shared
    2-core machine, it hardly moves with what else the machine is doing."""
    results = {}
    for stream in (False, True):
        kind = "streaming" if stream else "non-streaming"
        # Direct and through the gateway, alternately, `--repeats` times: the machine's noise
        # (other processes on two cores) drifts, and the median run is reported.
        runs = []
        for _ in range(args.repeats):
            direct = await load(stub_port, api_key, stream=stream, concurrency=1, count=args.latency_requests)
            cpu_before = _cpu_seconds(gateway_pid)
            through = await load(gateway_port, api_key, stream=stream, concurrency=1, count=args.latency_requests)
            through["cpu_ms_per_request"] = (
                1000 * (_cpu_seconds(gateway_pid) - cpu_before) / (args.latency_requests + 50)
            )
            runs.append(
                {
                    "direct": direct,
                    "gateway": through,
                    "added_p50_ms": through["p50_ms"] - direct["p50_ms"],
                    "added_p99_ms": through["p99_ms"] - direct["p99_ms"],
                }
            )
        median = sorted(runs, key=lambda run: run["added_p50_ms"])[len(runs) // 2]
        busy = await load(gateway_port, api_key, stream=stream, concurrency=args.concurrency, seconds=args.seconds)
        results[kind] = {
            **median,
            "gateway_loaded": busy,
            "added_p50_ms_runs": [round(run["added_p50_ms"], 3) for run in runs],
        }
    return results


def _report(args, results: dict, load_average) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import git_commit, write_json

    print(
        f"\n== gateway overhead ({args.processes} gateway process(es), {os.cpu_count()} cores, "
        f"load generator and stub on the same machine) =="
    )
    print(
        f"{'':16}{'added p50':>11}{'added p99':>11}{'direct p50':>12}{'gateway p50':>13}"
        f"{'req/s @' + str(args.concurrency):>11}{'loaded p50':>12}{'loaded p99':>12}{'CPU/req':>10}"
    )
    for kind, r in results.items():
        print(
            f"{kind:16}{r['added_p50_ms']:>9.2f}ms{r['added_p99_ms']:>9.2f}ms{r['direct']['p50_ms']:>10.2f}ms"
            f"{r['gateway']['p50_ms']:>11.2f}ms{r['gateway_loaded']['requests_per_s']:>11.0f}"
            f"{r['gateway_loaded']['p50_ms']:>10.2f}ms{r['gateway_loaded']['p99_ms']:>10.2f}ms"
            f"{r['gateway']['cpu_ms_per_request']:>8.2f}ms"
        )
    write_json(
        "gateway",
        {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(),
            "cores": os.cpu_count(),
            "load_average_before": load_average,
            "processes": args.processes,
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "repeats": args.repeats,
            "stream_chunks": STREAM_CHUNKS,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
