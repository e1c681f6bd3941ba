"""The batch TTFT benchmark (bench/batch_ttft.py): its figures and arguments, and the whole script on
the CPU with the tiny model on the embedded control plane (no PostgreSQL, no Redis: the Batch API's
Celery work runs on the SQLite broker)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.batch_ttft import parse_args, summarise

REPO = Path(__file__).resolve().parents[2]


def test_percentiles_both_ways_and_the_p99_ratio():
    figures = summarise([0.1, 0.2, 0.3], [0.2, 0.4, 0.6])
    assert figures["alone_ttft_p50_s"] == pytest.approx(0.2)
    assert figures["beside_ttft_p50_s"] == pytest.approx(0.4)
    assert figures["ttft_p99_ratio"] == pytest.approx(figures["beside_ttft_p99_s"] / figures["alone_ttft_p99_s"])
    assert figures["ttft_p99_ratio"] == pytest.approx(2.0)


def test_the_device_and_dtype_follow_the_model():
    tiny = parse_args([])
    assert (tiny.config, tiny.device, tiny.dtype) == (None, "cpu", "float32")
    full = parse_args(["--config", "bench/configs/llama-3-8b"])
    assert (full.device, full.dtype) == ("cuda", "bfloat16")
    smoke = parse_args(["--smoke", "--requests", "3"])
    assert (smoke.device, smoke.requests, smoke.batch_lines) == ("cpu", 3, 60)


def test_bad_counts_are_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--batch-lines", "0"])
    assert "--batch-lines" in capsys.readouterr().err


@pytest.mark.slow
def test_the_script_runs_beside_a_batch_without_postgres_or_redis(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    out = subprocess.run(
        [sys.executable, "bench/batch_ttft.py", "--smoke"],
        cwd=REPO,
        env={**env, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "batch_ttft.json").read_text())
    assert len(result["alone_ttft_s"]) == len(result["beside_ttft_s"]) == result["requests"] == 8
    for name in ("alone_ttft_p50_s", "alone_ttft_p99_s", "beside_ttft_p50_s", "beside_ttft_p99_s"):
        assert result[name] > 0
    assert result["ttft_p99_ratio"] == pytest.approx(result["beside_ttft_p99_s"] / result["alone_ttft_p99_s"])
    # The batch ran on the embedded broker (the run beside it waits for its first lines).
    assert result["batch_status"] in ("in_progress", "finalizing", "completed")
    assert result["batch_lines_completed"] >= 5 and result["batch_lines_answered"] >= 0
    assert "| alone |" in out.stdout and "| beside a batch (" in out.stdout
    assert "TTFT p99 beside the batch / alone" in out.stdout
