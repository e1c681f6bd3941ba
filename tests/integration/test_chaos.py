"""The chaos suite, short (`bench/chaos.py`): tenants send mixed traffic for a minute while a
replica is SIGKILLed, a daemon is SIGKILLed and restarted, and a private Redis and PostgreSQL are
each stopped and started; then the ledger must agree with what every client saw. Timings are
printed in the report, not asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import FAULTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def test_a_short_chaos_run_loses_no_charge_and_charges_none_twice(tmp_path):
    report_path = tmp_path / "report.json"
    # Its own PostgreSQL and Redis: the script ignores the suite's DATABASE_URL and REDIS_URL.
    run = subprocess.run(
        [sys.executable, "bench/chaos.py", "--duration", "60", "--tenants", "3", "--concurrency", "4",
         "--fault-interval", "6", "--seed", "1", "--json", str(report_path)],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    print(run.stdout)
    assert report_path.exists(), f"the chaos run did not finish (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    report = json.loads(report_path.read_text())
    audit = report["audit"]
    failed = {name: audit[name] for name in ("lost_charges", "double_charges", "overcharges", "duplicate_ids",
                                             "unexplained_records", "entries_not_matching_records", "holds_left",
                                             "balances_not_ledger", "negative_balances", "malformed")
              if audit[name]}
    assert not failed, report["table"]
    assert report["settled"], report["table"]
    assert audit["charged"] == audit["ledger_usage_entries"] > 0
    # The run exercised what it claims: every kind of fault, and clients served, refused and gone.
    assert {fault["kind"] for fault in report["faults"]} == set(FAULTS), report["table"]
    outcomes = report["outcomes"]
    assert outcomes.get("completed") and outcomes.get("left") and outcomes.get("error 429 insufficient_quota")
    assert run.returncode == 0, run.stderr[-6000:]
