"""The chaos suite, short (`bench/chaos.py`): tenants send mixed traffic for a minute while a
replica's process is SIGKILLed (found by the pid its daemon reports), a daemon is SIGKILLed and
restarted, and a private Redis and PostgreSQL are each stopped and started; then the ledger must
agree with what every client saw, and every fault must have acted. Timings are printed in the
report, not asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import FAULTS
from bench.chaos_audit import Audit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def test_a_short_chaos_run_loses_no_charge_and_charges_none_twice(tmp_path):
    report_path = tmp_path / "report.json"
    # Its own PostgreSQL and Redis: the script ignores the suite's DATABASE_URL and REDIS_URL.
    run = subprocess.run(
        [
            sys.executable,
            "bench/chaos.py",
            "--duration",
            "60",
            "--tenants",
            "3",
            "--concurrency",
            "4",
            "--fault-interval",
            "6",
            "--seed",
            "3",
            "--json",
            str(report_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    print(run.stdout)
    assert report_path.exists(), (
        f"the chaos run did not finish (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    )
    report = json.loads(report_path.read_text())
    audit = report["audit"]
    failed = {name: audit[name] for name in Audit.PROBLEMS if audit[name]}
    assert not failed, report["table"]
    assert report["settled"], report["table"]
    assert audit["charged"] == audit["ledger_usage_entries"] > 0
    # The run exercised what it claims: every kind of fault, each acting on something, and clients
    # served, refused and gone.
    assert {fault["kind"] for fault in report["faults"]} == set(FAULTS), report["table"]
    assert not [fault for fault in report["faults"] if fault["problem"]], report["table"]
    outcomes = report["outcomes"]
    assert outcomes.get("completed") and outcomes.get("left") and outcomes.get("error 429 insufficient_quota")
    # Each replica kill killed the process its daemon reported: the daemon saw it die of SIGKILL,
    # the control plane recorded the replica crashed, a new replica became ready, and a request
    # sent after the kill was served.
    kills = [fault for fault in report["faults"] if fault["kind"] == "replica_kill"]
    assert kills, report["table"]
    for kill in kills:
        assert kill["pid"] and kill["replica_id"], kill
        assert kill["failure_seen"].startswith("crashed: the replica process was killed by SIGKILL"), kill
        assert kill["replaced_s"] is not None and kill["recovered_s"] is not None, kill
    assert run.returncode == 0, run.stderr[-6000:]
