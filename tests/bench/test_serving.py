"""The serving benchmark (bench/serving.py): its figures from client records, its load generator
against a server that is not there, and the whole script on the CPU with a tiny model."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import free_port
from bench.serving import (
    Record,
    Request,
    parse_engine_modes,
    parse_rates,
    poisson_arrivals,
    replica_device,
    run_load,
    summarise,
)

REPO = Path(__file__).resolve().parents[2]


def _record(sent: float, chunks: list[float], tokens: int, expected: int | None = None, error=None) -> Record:
    return Record(expected or tokens, sent=sent, chunks=chunks, output_tokens=tokens, error=error)


def test_latencies_throughput_and_goodput_come_from_the_stream_times():
    load = {
        "records": [
            _record(0.0, [0.5, 0.52, 0.54], 3),  # TTFT 0.5 s, TPOT 20 ms: within the SLO
            _record(1.0, [3.0, 3.1, 3.2], 3),  # TTFT 2 s: outside
            _record(1.0, [1.2, 1.5], 2),  # TPOT 300 ms: outside
            _record(2.0, [2.1], 1, expected=4),  # stopped after 1 of 4 tokens: failed
            _record(2.0, [], 0, error="HTTP 500"),
        ],
        "client_cpu_share": [0.1, 0.2],
        "send_lags": [0.0, 0.001, 0.002, 0.003, 0.004],
    }
    summary = summarise(load)
    assert summary["requests"] == 5 and summary["failed"] == 2
    assert summary["first_error"] == "1 of 4 tokens"
    assert summary["seconds"] == pytest.approx(3.2)  # first send to last answer
    assert summary["requests_per_s"] == pytest.approx(3 / 3.2)
    assert summary["output_tok_s"] == pytest.approx(8 / 3.2)
    assert summary["goodput_requests_per_s"] == pytest.approx(1 / 3.2)
    assert summary["goodput_output_tok_s"] == pytest.approx(3 / 3.2)
    assert summary["slo_attained"] == pytest.approx(1 / 5)
    assert summary["ttft_p50_s"] == pytest.approx(0.5)  # of 0.5, 2.0 and 0.2
    assert summary["ttft_p99_s"] == pytest.approx(0.5 + 0.98 * (2.0 - 0.5))  # linear between ranks
    assert summary["tpot_p50_s"] == pytest.approx(0.1)  # of 0.02, 0.1 and 0.3
    assert summary["itl_p50_s"] == pytest.approx(0.1)  # of 0.02, 0.02, 0.1, 0.1, 0.3
    assert summary["client_cpu_share"] == [0.1, 0.2]


def test_poisson_arrivals_are_seeded_and_average_the_rate():
    arrivals = poisson_arrivals(20.0, 100.0, seed=3)
    assert arrivals == poisson_arrivals(20.0, 100.0, seed=3)
    assert arrivals != poisson_arrivals(20.0, 100.0, seed=4)
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] <= 100.0
    assert 1800 < len(arrivals) < 2200  # 2,000 expected; this seed's count is fixed


@pytest.mark.parametrize("text", ["0", "-5", "fast", "5,,10"])
def test_bad_rates_are_refused_naming_the_option(text):
    with pytest.raises(Exception, match="rate|could not convert"):
        parse_rates(text)


@pytest.mark.parametrize("text", ["", "thread", "process,fast"])
def test_bad_engine_modes_are_refused_naming_the_option(text):
    with pytest.raises(Exception, match="--engine-modes"):
        parse_engine_modes(text)


def test_rates_include_all_at_once():
    assert parse_rates("5,10.5,inf") == [5.0, 10.5, math.inf]


def test_a_server_that_is_not_there_fails_every_request_and_the_run_still_ends():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    load = run_load([url], [Request([1, 2, 3], 4, 0.0), Request([4, 5], 4, 0.01), Request([6], 4, 0.02)], processes=2)
    assert len(load["records"]) == 3 and len(load["client_cpu_share"]) == 2
    assert all(not r.ok and "ConnectError" in r.error for r in load["records"])
    summary = summarise(load)
    assert summary["failed"] == 3 and summary["ttft_p50_s"] is None and "ConnectError" in summary["first_error"]


@pytest.mark.slow
def test_the_smoke_run_serves_every_request_and_writes_the_figures_and_plot(tmp_path):
    plot = tmp_path / "serving.png"
    out = subprocess.run(
        [sys.executable, "bench/serving.py", "--smoke", "--plot", str(plot), "--engine-modes", "process,in-process"],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "serving.json").read_text())
    assert result["offline"]["output_tok_s"] > 0
    assert [(run["engine_mode"], run["rate"]) for run in result["runs"]] == [
        ("process", "all at once"),
        ("process", "4 req/s"),
        ("in-process", "all at once"),
        ("in-process", "4 req/s"),
    ]
    for run in result["runs"]:
        assert run["failed"] == 0 and run["output_tok_s"] > 0 and run["ttft_p50_s"] > 0
    assert plot.stat().st_size > 0
    assert "x offline" in out.stdout and "TTFT p50/p99" in out.stdout


def test_a_client_process_that_fails_stops_the_run_with_its_reason():
    url = f"http://127.0.0.1:{free_port()}"
    unsendable = Request({1, 2}, 4, 0.0)  # a set is no JSON: the client's own bug, not a failed request
    with pytest.raises(RuntimeError, match="a client process failed: TypeError.*JSON serializable"):
        run_load([url], [Request([1], 4, 0.0), unsendable], processes=1)


def test_replicas_start_tensor_parallel_size_gpus_apart():
    assert [replica_device("cuda", i * 2) for i in range(2)] == ["cuda:0", "cuda:2"]
    assert replica_device("cuda:1", 4) == "cuda:5" and replica_device("cpu", 3) == "cpu"


@pytest.mark.slow
def test_requests_go_to_the_least_busy_of_several_replicas(tmp_path):
    # Issue 25's "two TP=1 replicas behind the gateway's routing": two tiny CPU replicas, the burst
    # of 6 sent at once by 2 clients, each client sending to the replica with fewer outstanding.
    out = subprocess.run(
        [
            sys.executable,
            "bench/serving.py",
            "--smoke",
            "--replicas",
            "2",
            "--engine-modes",
            "in-process",
            "--skip-offline",
        ],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "serving.json").read_text())
    burst = result["runs"][0]
    assert burst["rate"] == "all at once" and burst["failed"] == 0
    # Each client's 3 go 0, 1, 0 (its own counts: 0/0, then 1/0, then 1/1), so both replicas serve.
    assert burst["requests_per_replica"] == [4, 2]
    assert "2 replica(s) of tensor parallel 1" in result["model"]


def test_the_script_loads_without_the_control_planes_packages():
    # The GPU machine has neither Celery nor Django: the routing rule must not import the controlplane
    # package (a run there failed at import).
    blocked = "import sys; sys.modules.update(celery=None, django=None); sys.path.insert(0, 'bench'); import serving"
    out = subprocess.run(
        [sys.executable, "-c", blocked + "; print(serving.least_outstanding.__name__)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "least_outstanding"
