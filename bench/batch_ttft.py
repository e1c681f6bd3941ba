"""Interactive time to first token with and without a Batch API job filling the replica.

    python bench/batch_ttft.py [--requests 60] [--concurrency 2] [--batch-lines 400] [--max-tokens 8]
    python bench/batch_ttft.py --config bench/configs/llama-3-8b --device cuda --dtype bfloat16
    python bench/batch_ttft.py --smoke                 # CPU, the tiny model, a few requests (tests)

It runs the embedded set-up `make run` uses (bench/embedded.py), so it needs no PostgreSQL and no
Redis (DATABASE_URL and REDIS_URL are ignored): a fresh VAR_DIR with the SQLite database (migrated,
then seeded through the services: a tenant with ample credit and high limits, its key, the chat
model and its deployment, its objective at the maximum so nothing is shed), the file cache, and
the SQLite broker. The replica is `python -m gpuworker serve` on a random checkpoint: without
--config a tiny random Llama (CPU, float32, by default), with --config one of that shape (bench/
serving.py's prepare_model; CUDA and bfloat16 by default). The gateway is uvicorn over
controlplane.asgi; the Batch API's runner is the Celery worker as `make run` starts it; in place
of the worker daemon this process records the replica's /stats through the fleet's heartbeat
service. The Celery worker sees the web server's requests in flight through the live cache's
files (no Redis), so BATCH_REPLICA_BUSY_AT holds batch lines back as it does with Redis, and the
engine's priority classes order what reaches a replica.

It streams --requests chat completions at --concurrency through the gateway (each client pausing
--pause-ms between requests, the idle gaps batch work may fill; greedy, ignore_eos) and times each
one's first content token, first alone, then while a batch of --batch-lines chat requests of
4 x --max-tokens runs (BATCH_CONCURRENCY lines in flight). It prints TTFT p50/p99 both ways, the
p99 ratio (beside / alone) and the batch lines answered meanwhile, and writes batch_ttft.json
(bench.common.write_json). Seeded and warmed up; the numbers are this machine's, printed with its
commit.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import environment, write_json  # noqa: E402
from bench.embedded import NO_OBJECTIVE_MS, embedded_system  # noqa: E402
from bench.serving import percentile, prepare_model  # noqa: E402

MODEL = "bench-batch"
CONTEXT_LENGTH = 256
WARMUP_REQUESTS = 10
# Completed lines before the interactive run starts beside the batch: its runner is at work.
BATCH_STARTED_LINES = 5
BATCH_START_DEADLINE_S = 300.0
SMOKE = {"requests": 8, "batch_lines": 60, "max_tokens": 4, "pause_ms": 50}


async def interactive(
    base_url: str, key: str, *, requests: int, concurrency: int, max_tokens: int, pause_s: float
) -> list[float]:
    """Each streamed chat's time to its first content token, in seconds (to its end when it has
    none); each client pauses `pause_s` between its requests."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=600)
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
                extra_body={"ignore_eos": True},
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


def start_batch(base_url: str, key: str, lines: int, max_tokens: int) -> str:
    """Uploads `lines` chat requests and creates their batch: its id."""
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
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )
    uploaded = client.files.create(file=("bench.jsonl", io.BytesIO(raw)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id


def batch_counts(base_url: str, key: str, batch_id: str) -> tuple[str, int]:
    """The batch's status and its completed lines."""
    import openai

    batch = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0).batches.retrieve(batch_id)
    return batch.status, batch.request_counts.completed


def wait_batch_started(base_url: str, key: str, batch_id: str, lines: int) -> int:
    """Until the batch has `lines` completed lines: how many it has."""
    started = time.monotonic()
    while time.monotonic() - started < BATCH_START_DEADLINE_S:
        status, completed = batch_counts(base_url, key, batch_id)
        if completed >= lines:
            return completed
        if status in ("failed", "expired", "cancelled"):
            raise RuntimeError(f"the batch ended {status} before it started")
        time.sleep(0.2)
    raise RuntimeError(f"the batch completed fewer than {lines} lines within {BATCH_START_DEADLINE_S:.0f} s")


def summarise(alone: list[float], beside: list[float]) -> dict:
    """TTFT p50/p99 alone and beside the batch, and the p99 ratio (beside / alone)."""
    figures = {
        "alone_ttft_p50_s": percentile(alone, 50),
        "alone_ttft_p99_s": percentile(alone, 99),
        "beside_ttft_p50_s": percentile(beside, 50),
        "beside_ttft_p99_s": percentile(beside, 99),
    }
    figures["ttft_p99_ratio"] = figures["beside_ttft_p99_s"] / figures["alone_ttft_p99_s"]
    return figures


def measure(args, url: str, key: str) -> dict:
    """Warm-up, the interactive run alone, then again beside a running batch."""
    load = dict(
        requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens, pause_s=args.pause_ms / 1000
    )
    asyncio.run(interactive(url, key, **{**load, "requests": WARMUP_REQUESTS}))
    alone = asyncio.run(interactive(url, key, **load))
    batch_id = start_batch(url, key, args.batch_lines, 4 * args.max_tokens)
    before = wait_batch_started(url, key, batch_id, min(BATCH_STARTED_LINES, args.batch_lines))
    started = time.perf_counter()
    beside = asyncio.run(interactive(url, key, **load))
    seconds = time.perf_counter() - started
    status, after = batch_counts(url, key, batch_id)
    return {
        **summarise(alone, beside),
        "batch_lines_answered": after - before,
        "batch_lines_completed": after,
        "batch_seconds": round(seconds, 3),
        "batch_status": status,
        "alone_ttft_s": sorted(round(t, 4) for t in alone),
        "beside_ttft_s": sorted(round(t, 4) for t in beside),
    }


def report(result: dict) -> None:
    env = result["environment"]
    print(f"\n# batch_ttft  commit {env['commit']}  gpu {env['gpu']}  torch {env['torch']}  {env['date']}")
    print(
        f"# {result['model']} on {result['device']}; {result['requests']} streamed chats at concurrency "
        f"{result['concurrency']} (each client pausing {result['pause_ms']} ms between requests), max_tokens "
        f"{result['max_tokens']}; a batch of {result['batch_lines']} lines of max_tokens {4 * result['max_tokens']}"
    )
    print("| interactive load | TTFT p50 (ms) | TTFT p99 (ms) | batch lines answered meanwhile |")
    print("|---|---:|---:|---:|")
    print(f"| alone | {1000 * result['alone_ttft_p50_s']:.0f} | {1000 * result['alone_ttft_p99_s']:.0f} | - |")
    print(
        f"| beside a batch ({result['batch_status']}) | {1000 * result['beside_ttft_p50_s']:.0f} "
        f"| {1000 * result['beside_ttft_p99_s']:.0f} | {result['batch_lines_answered']} in "
        f"{result['batch_seconds']:.1f} s |"
    )
    print(
        f"# TTFT p99 beside the batch / alone: {result['ttft_p99_ratio']:.2f} "
        f"({100 * (result['ttft_p99_ratio'] - 1):+.0f}%; target: at most +10%)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None, help="a model's shape (default: a tiny random Llama)")
    parser.add_argument("--checkpoint", type=Path, default=Path("/root/ckpt-serving"), help="--config's, written once")
    parser.add_argument("--device", default=None, help="default: cuda with --config, else cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 with --config, else float32")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--batch-lines", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=8, help="interactive; batch lines get 4x")
    parser.add_argument("--pause-ms", type=int, default=200, help="each interactive client's pause between requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, a few requests (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.device, args.dtype = None, "cpu", "float32"
        for name, value in SMOKE.items():
            if parser.get_default(name) == getattr(args, name):
                setattr(args, name, value)
    args.device = args.device or ("cuda" if args.config else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.config else "float32")
    for name in ("requests", "concurrency", "batch_lines", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-batch-ttft-"))
    # prepare_model's tiny model is its smoke one.
    made = argparse.Namespace(smoke=args.config is None, seed=args.seed, checkpoint=args.checkpoint, config=args.config)
    model = prepare_model(made, workdir)
    system = embedded_system(
        model,
        workdir=workdir,
        served_model=MODEL,
        kind="chat",
        device=args.device,
        dtype=args.dtype,
        context_length=CONTEXT_LENGTH,
        ttft_slo_ms=NO_OBJECTIVE_MS,
        celery_worker=True,
    )
    with system as running:
        result = measure(args, running.url, running.key)
    result |= {
        "environment": environment(),
        "model": str(args.config) if args.config else "tiny random Llama",
        "device": args.device,
        "dtype": args.dtype,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "pause_ms": args.pause_ms,
        "max_tokens": args.max_tokens,
        "batch_lines": args.batch_lines,
    }
    report(result)
    write_json("batch_ttft", result)


if __name__ == "__main__":
    main()
