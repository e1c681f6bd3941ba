"""bench/fairness.py end to end on the CPU with a tiny model: every run of both scheduling policies
is reported, with the issue's figures, a JSON and a plot; and its fairness arithmetic."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_short_ttft import TINY_CONFIG

REPO = Path(__file__).resolve().parents[2]


def test_the_cpu_run_reports_both_policies_with_a_plot(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    argv = [sys.executable, "bench/fairness.py", "--config", str(tmp_path / "model"), "--device", "cpu"]
    argv += ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--prompt-len", "8,24"]
    argv += ["--output-len", "2,6", "--duration", "1", "--capacity-requests", "8", "--plot", str(out / "fair.png")]
    done = subprocess.run(
        argv, cwd=REPO, env={**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fair / fcfs total output tok/s" in done.stdout
    result = json.loads((out / "fairness.json").read_text())
    assert set(result["runs"]) == {
        "A alone",
        "two tenants, fcfs",
        "two tenants, fair",
        "interactive + batch, fcfs",
        "interactive + batch, fair",
    }
    assert set(result["runs"]["two tenants, fair"]["tenants"]) == {"A", "B"}
    assert set(result["runs"]["interactive + batch, fcfs"]["tenants"]) == {"interactive", "batch"}
    assert result["capacity_requests_per_s"] > 0
    assert (out / "fair.png").stat().st_size > 0


def test_jain_index_and_percentiles(bench_script):
    fairness = bench_script("fairness")
    assert fairness.jain_index([3.0, 3.0]) == 1.0
    assert fairness.jain_index([1.0, 0.0]) == 0.5
    assert fairness.jain_index([1.0, 4.0]) == pytest.approx(25 / 34)
    assert fairness.percentile([], 99) is None
    assert fairness.percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert fairness.percentile([5.0, 1.0], 50) == 1.0
