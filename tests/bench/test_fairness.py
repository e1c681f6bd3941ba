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


def _cpu_run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    argv = [sys.executable, "bench/fairness.py", "--config", str(tmp_path / "model"), "--device", "cpu"]
    argv += ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--prompt-len", "8,24"]
    argv += ["--output-len", "2,6", "--duration", "1", "--capacity-requests", "8", "--plot", str(out / "fair.png")]
    return subprocess.run(
        [*argv, *extra],
        cwd=REPO,
        env={**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )


def test_the_cpu_run_reports_both_policies_with_a_plot(tmp_path):
    out = tmp_path / "out"
    done = _cpu_run(tmp_path)
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
    a = result["runs"]["two tenants, fair"]["tenants"]["A"]
    assert a["offered_weighted_tokens"] >= a["requests"] * (8 + 2 * 2)  # prompts of 8+, 2+ tokens out
    assert "fair: A's demand / half the service" in result["figures"]
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


def test_a_run_of_some_policies_and_workloads_reports_their_figures_only(tmp_path):
    """A short GPU call runs what it needs (the fair policy's interactive beside batch, against A alone)."""
    done = _cpu_run(tmp_path, "--policies", "fair", "--workloads", "classes")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "fairness.json").read_text())
    assert set(result["runs"]) == {"A alone", "interactive + batch, fair"}
    assert set(result["figures"]) == {"fair: interactive TTFT p99 / no batch"}
    assert "steps" in result["runs"]["interactive + batch, fair"]
    assert not (tmp_path / "out" / "fair.png").exists()


def test_an_unknown_policy_is_refused_by_name(tmp_path):
    done = _cpu_run(tmp_path, "--policies", "fair,lottery")
    assert done.returncode == 2
    assert "--policies" in done.stderr
