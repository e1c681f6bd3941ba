"""Stall: does one tenant's huge prompt freeze another tenant's stream on the same replica?

    python bench/stall.py [--sizes-mb 1 4] [--code before=/path/to/old/checkout --code after=.]

Starts a replica (`python -m gpuworker serve`, CPU, the demo model written to a temporary folder)
for each `--code` (a checkout whose `gpuworker` the replica imports; default: this one), streams
one completion, and once it runs sends a chat and a completion prompt of each size to the same
replica, one at a time. Both are refused (400 context_length_exceeded) after being rendered and
tokenized; what matters is the stream meanwhile: the gaps between its chunks from the huge
request's send to its answer. Printed: max and median gap per case (target: max <= 100 ms).
The huge bodies are encoded before the stream starts, so the client spends no time on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-stall-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(code: Path, model: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(code)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuworker",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--token",
            TOKEN,
            "--max-model-len",
            "2048",
            "--log-level",
            "warning",
        ],
        cwd=code,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the replica exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/health", headers=HEADERS, timeout=2).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("the replica did not become ready within 300 s")


def huge_body(kind: str, size: int) -> tuple[str, bytes]:
    text = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    if kind == "chat":
        return "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
        ).encode()
    return "/v1/completions", json.dumps({"prompt": text, "max_tokens": 4}).encode()


async def measure(base: str, path: str | None, body: bytes | None, warmup_chunks: int = 20) -> dict:
    """Stream one completion; after `warmup_chunks`, send the huge request (if any) and return the
    stream's chunk gaps while it was in flight (or over the next second without one)."""
    arrivals: list[float] = []
    window: dict[str, float] = {}
    huge: dict = {}
    async with httpx.AsyncClient(base_url=base, headers=HEADERS, timeout=600) as client:
        started = asyncio.Event()

        async def stream() -> None:
            async with client.stream(
                "POST", "/v1/completions", json={"prompt": "go", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.perf_counter())
                        if len(arrivals) == warmup_chunks:
                            started.set()

        streamer = asyncio.create_task(stream())
        await started.wait()
        window["start"] = time.perf_counter()
        if path is None:
            await asyncio.sleep(1.0)
        else:
            async with httpx.AsyncClient(
                base_url=base, headers={**HEADERS, "content-type": "application/json"}, timeout=600
            ) as other:
                response = await other.post(path, content=body)
            huge = {"status": response.status_code, "code": (response.json().get("error") or {}).get("code")}
        window["end"] = time.perf_counter()
        await asyncio.sleep(0.2)  # the gap that spans the end of the window is counted too
        streamer.cancel()
        try:
            await streamer
        except asyncio.CancelledError:
            pass
    stream_done = streamer.done() and not streamer.cancelled() and streamer.exception() is None
    times = [t for t in arrivals if t >= window["start"]]
    inside = [t for t in times if t <= window["end"]]
    gaps = [b - a for a, b in zip(times, times[1:]) if a <= window["end"]]
    return {
        "seconds": window["end"] - window["start"],
        "chunks": len(inside),
        "huge": huge,
        "max_gap_ms": max(gaps) * 1000 if gaps else float("inf"),
        "p50_gap_ms": statistics.median(gaps) * 1000 if gaps else float("inf"),
        "stream_ended_early": stream_done,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4])
    parser.add_argument(
        "--code",
        action="append",
        default=None,
        metavar="LABEL=PATH",
        help="a checkout to run the replica from (repeatable; default: this one)",
    )
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint (default: the demo model)")
    args = parser.parse_args(argv)
    codes = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in args.code or [f"this={REPO}"]]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "demo"
            subprocess.run(
                [sys.executable, "-m", "gpuworker.demo_model", str(model)],
                check=True,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
            )
        cases = [("none", None, None)] + [
            (f"{kind} {mb:g} MB", *huge_body(kind, int(mb * 1024 * 1024)))
            for mb in args.sizes_mb
            for kind in ("chat", "completion")
        ]
        rows = []
        for label, code in codes:
            process, base = start_replica(code, model)
            try:
                asyncio.run(measure(base, None, None))  # warm-up
                for name, path, body in cases:
                    result = asyncio.run(measure(base, path, body))
                    rows.append((label, name, result))
                    print(f"  {label:8} {name:18} max {result['max_gap_ms']:8.1f} ms", file=sys.stderr)
            finally:
                process.kill()
                process.wait()
    print(f"\ncores: {os.cpu_count()}  python {sys.version.split()[0]}\n")
    print("| code | huge request | its answer | its time (s) | stream chunks meanwhile | max gap (ms) | p50 gap (ms) |")
    print("|---|---|---|---|---|---|---|")
    for label, name, r in rows:
        answer = f"{r['huge']['status']} {r['huge']['code'] or ''}".strip() if r["huge"] else "-"
        print(
            f"| {label} | {name} | {answer} | {r['seconds']:.2f} | {r['chunks']} | {r['max_gap_ms']:.1f} | "
            f"{r['p50_gap_ms']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
