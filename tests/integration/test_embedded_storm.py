"""The embedded default under load, short (`bench/embedded_storm.py`): `python -m controlplane.launcher`
on a fresh VAR_DIR (SQLite, the SQLite broker; no PostgreSQL or Redis) takes scale actions, fleet
tasks and /v1 requests for 75 s while its Celery worker is SIGKILLed once: the launcher brings the
worker back, a scale action after that reaches the GPU worker daemon, every process is alive at the
end, no message to the daemon is lost, and Ctrl-C still stops everything with status 0."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def test_a_short_storm_with_the_celery_worker_killed_leaves_every_process_alive_and_loses_nothing(tmp_path):
    report_path = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.embedded_storm", "--duration", "75", "--scale-interval", "4", "--seed", "1",
         "--json", str(report_path)],
        cwd=REPO, capture_output=True, text=True, timeout=840)
    print(run.stdout)
    assert report_path.exists(), (f"the storm did not finish (exit {run.returncode}):\n{run.stdout[-3000:]}\n"
                                  f"{run.stderr[-6000:]}")
    report = json.loads(report_path.read_text())
    assert "processes" in report, report["problems"]
    processes, account = report["processes"], report["account"]
    # The worker was killed once and came back; nothing else exited, and everything is alive.
    assert {name: row["alive"] for name, row in processes.items()} == dict.fromkeys(
        ("web", "worker", "beat", "gpuworker"), True), report["table"]
    assert processes["worker"]["starts"] == 2, report["table"]
    assert processes["worker"]["exits"] == ["status -9 (SIGKILL)"], report["table"]
    assert all(not row["exits"] for name, row in processes.items() if name != "worker"), report["table"]
    # Tasks flowed again after the restart: a replica placed since then was loaded by the daemon.
    [kill] = report["kills"]
    assert kill["child"] == "worker" and kill["loads_taken_after_restart"] >= 1, report["table"]
    assert report["scale_actions"] >= 5, report["table"]
    # Every message to the daemon was taken, or healed by reconcile or a heartbeat; none lost.
    assert account["loads"]["lost"] == account["unloads"]["lost"] == 0, report["table"]
    assert account["loads"]["taken"] > 0 and account["json_decode_errors"] == 0, report["table"]
    assert report["launcher_exit"] == 0 and report["ok"], report["table"]
    assert run.returncode == 0, run.stderr[-6000:]
