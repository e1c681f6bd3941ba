"""The embedded storm's replica kill (bench/embedded_storm.py) against what it acts on: it finds its target
by the pid the launcher's GPU worker daemon reports in its heartbeats, signals only a child of that daemon,
and a kill that finds nothing, or whose failure is never recorded, fails the storm. The storm over a real
embedded system runs in tests/integration/test_embedded_storm.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from bench import embedded_storm
from bench.embedded_storm import REPLICA, TRAFFIC_MODEL, Storm, judge
from bench.replica_faults import alive
from controlplane.fleet.models import Replica
from tests.bench.conftest import REPLICA_URL, replica_reporter, wait_dead
from tests.controlplane.factories import DeploymentFactory, ModelFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker

# Committed: the storm looks at the fleet as the storm process does, with close_old_connections().
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def storm(tmp_path, daemon, monkeypatch):
    """A storm whose launcher (this process, which started the daemon) said it started the daemon, with one
    ready storm-a replica on the daemon's worker, reported as the test says."""
    monkeypatch.setattr(embedded_storm, "REPLICA_TARGET_WAIT_S", 1)
    monkeypatch.setattr(embedded_storm, "REPLICA_FAILED_WAIT_S", 1)
    storm = Storm(tmp_path, seed=0)
    storm.launcher = SimpleNamespace(pid=os.getpid())
    storm.log_path.write_text(f"launcher  | started gpuworker (pid {daemon[0].pid})\n")
    [name] = storm.daemons()
    deployment = DeploymentFactory(model=ModelFactory(public_name=TRAFFIC_MODEL), desired_replicas=1)
    replica = ReplicaFactory(
        deployment=deployment, worker=make_worker(name=name), state=Replica.State.READY, endpoint_url=REPLICA_URL
    )

    report = replica_reporter(replica)
    return storm, replica, report


def _passing_report(kills: list[dict]) -> dict:
    """A storm's report with nothing wrong but its kills."""
    return {
        "processes": {name: {"pid": 1, "alive": True, "starts": 1, "exits": []} for name in embedded_storm.CHILDREN},
        "account": {"loads": {"lost": 0}, "unloads": {"lost": 0}, "json_decode_errors": 0},
        "kills": kills,
        "launcher_exit": 0,
    }


@pytest.mark.parametrize("reported", ["no pid", "a process of no daemon", "a stopped daemon's process"])
def test_a_replica_kill_that_finds_no_replica_process_fails_the_storm_and_signals_nothing(
    storm, daemon, processes, reported
):
    storm, replica, report = storm
    stranger = processes(["sleep", "300"])
    if reported == "no pid":
        report()
    elif reported == "a process of no daemon":  # a pid the host gave some other process
        report(pid=stranger.pid)
    else:  # the daemon the launcher's lines name is gone; its child lives on
        report(pid=daemon[1])
        daemon[0].kill()
        daemon[0].wait()

    storm.kill_replica()
    [kill] = storm.kills
    assert kill["problem"].startswith(f"no ready {TRAFFIC_MODEL} replica with a live process the daemon reported")
    assert "pid" not in kill and alive(stranger.pid) and alive(daemon[1])
    assert judge(_passing_report(storm.kills), [REPLICA], settled=True) == [
        f"replica kill at {kill['at_s']:.0f}s: {kill['problem']}"
    ]
    assert "NO EFFECT" in embedded_storm.kill_line(kill)


def test_a_replica_kill_kills_the_reported_process_and_fails_the_storm_when_no_failure_is_recorded(storm, daemon):
    storm, replica, report = storm
    report(pid=daemon[1])

    storm.kill_replica()
    [kill] = storm.kills
    assert (kill["killed"], kill["replica_id"], kill["pid"]) == (True, replica.pk, daemon[1]) and wait_dead(daemon[1])
    # Nothing here is a real daemon: no one reports the replica failed, and the storm says so.
    assert kill["problem"] == f"replica {replica.pk} was not recorded failed within 1s"
    assert judge(_passing_report(storm.kills), [REPLICA], settled=True) == [
        f"replica kill at {kill['at_s']:.0f}s: {kill['problem']}"
    ]


def test_a_storm_whose_kills_acted_passes_and_one_with_a_kill_missing_fails():
    acted = {"child": REPLICA, "at_s": 10.0, "killed": True, "problem": ""}
    assert judge(_passing_report([acted]), [REPLICA], settled=True) == []
    assert judge(_passing_report([acted]), [REPLICA, REPLICA], settled=True) == ["1 of 2 kills were made"]


@pytest.mark.parametrize(
    "kill, message",
    [("replica,bogus", "--kill names ['bogus']"), ("worker,replica,worker", "--kill names worker more than once")],
)
def test_kill_names_only_children_once_each_and_replicas(kill, message, capsys):
    with pytest.raises(SystemExit) as exit:
        embedded_storm.main(["--kill", kill])
    assert exit.value.code == 2 and message in capsys.readouterr().err
