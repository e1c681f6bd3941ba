"""The embedded default under load, short (`bench/embedded_storm.py`): `python -m controlplane.launcher`
on a fresh VAR_DIR (SQLite, the SQLite broker; no PostgreSQL or Redis) takes scale actions, fleet
tasks and /v1 requests for 75 s while its Celery worker is SIGKILLed once, then a replica's process
(found by the pid the GPU worker daemon reports): the launcher brings the worker back, a scale action
after that reaches the daemon, the killed replica is recorded failed and replaced and requests are
served again, every process is alive at the end, no message to the daemon is lost, and Ctrl-C still
stops everything with status 0."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.launcher import process_specs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def test_a_short_storm_with_the_celery_worker_and_a_replica_killed_leaves_every_process_alive_and_loses_nothing(
    tmp_path,
):
    report_path = tmp_path / "report.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.embedded_storm",
            "--duration",
            "75",
            "--scale-interval",
            "4",
            "--seed",
            "1",
            "--kill",
            "worker,replica",
            "--json",
            str(report_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
    )
    print(run.stdout)
    assert report_path.exists(), (
        f"the storm did not finish (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    )
    report = json.loads(report_path.read_text())
    assert "processes" in report, report["problems"]
    processes, account = report["processes"], report["account"]
    # The worker was killed once and came back; nothing else exited, and everything is alive.
    children = [spec.name for spec in process_specs(host="127.0.0.1", port=0) if not spec.once]
    assert {name: row["alive"] for name, row in processes.items()} == dict.fromkeys(children, True), report["table"]
    assert processes["worker"]["starts"] == 2, report["table"]
    assert processes["worker"]["exits"] == ["status -9 (SIGKILL)"], report["table"]
    assert all(not row["exits"] for name, row in processes.items() if name != "worker"), report["table"]
    # Tasks flowed again after the restart: a replica placed since then was loaded by the daemon.
    kill, replica_kill = report["kills"]
    assert kill["child"] == "worker" and kill["loads_taken_after_restart"] >= 1, report["table"]
    # The replica kill killed the process the daemon reported: the daemon saw it die of SIGKILL, the
    # control plane recorded the replica crashed, a replica created after it became ready, and a
    # request was served after that, with no other process exiting.
    assert replica_kill["child"] == "replica" and replica_kill["killed"] and not replica_kill["problem"], report[
        "table"
    ]
    assert replica_kill["pid"] and replica_kill["replica_id"], report["table"]
    assert replica_kill["failure_seen"].startswith("crashed: the replica process was killed by SIGKILL"), report[
        "table"
    ]
    assert replica_kill["replaced_by"] > replica_kill["replica_id"], report["table"]
    assert replica_kill["served_again_s"] is not None and report["traffic"].get("200"), report["table"]
    assert account["failures"].get("crashed") == 1, report["table"]
    assert report["scale_actions"] >= 5, report["table"]
    # Every message to the daemon was taken, or healed by reconcile or a heartbeat; none lost.
    assert account["loads"]["lost"] == account["unloads"]["lost"] == 0, report["table"]
    assert account["loads"]["taken"] > 0 and account["json_decode_errors"] == 0, report["table"]
    assert report["launcher_exit"] == 0 and report["ok"], report["table"]
    assert run.returncode == 0, run.stderr[-6000:]
