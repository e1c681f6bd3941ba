"""bench/multiturn.py end to end on the CPU with a tiny model (--smoke): the four runs, with
host-tier hits only where the tier is on and conversations share their history, a table and a plot."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_smoke_run_compares_the_host_tier_with_gpu_only_caching(tmp_path):
    plot = tmp_path / "multiturn.png"
    done = subprocess.run(
        [sys.executable, "bench/multiturn.py", "--smoke", "--plot", str(plot)],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "multi-turn TTFT: host KV tier against GPU-only prefix caching" in done.stdout
    runs = json.loads((tmp_path / "multiturn.json").read_text())["runs"]
    by = {(r["workload"], r["host_tier"]): r for r in runs}
    assert list(by) == [("reuse", False), ("reuse", True), ("no-reuse", False), ("no-reuse", True)]
    for run in runs:
        assert run["requests"] == 6 * 3 and len(run["turn_ttft_p50_s"]) == 3
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
        assert run["gpu_kv_tokens"] == 512
    # The working set (6 histories of up to 256 tokens) exceeds the 512-token GPU pool: with the
    # tier, histories come back from host memory; without it, or without reuse, nothing does.
    tier = by[("reuse", True)]
    assert tier["host_hit_rate"] > 0 and tier["blocks_restored"] > 0 and tier["host_kv_tokens"] > 0
    assert tier["prefix_hit_rate"] > by[("reuse", False)]["prefix_hit_rate"]
    assert by[("reuse", False)]["host_hit_rate"] == 0
    # No prompt shares another's prefix: the only hits are a preempted request finding its own blocks.
    assert by[("no-reuse", True)]["prefix_hit_rate"] < tier["prefix_hit_rate"] / 4
    assert plot.stat().st_size > 0
