"""The chaos suite's faults (bench/chaos.py) against what they act on: a replica kill finds its
target by the pid the worker's daemon reports in its heartbeats, signals only a process of a daemon
of the run, and a fault that finds nothing to act on, or whose effect is never seen, fails the
run's audit. The whole suite over a real fleet runs in tests/integration/test_chaos.py."""

from __future__ import annotations

import pytest

from bench import chaos as chaos_module
from bench.chaos import Chaos, fault_problems
from bench.chaos_audit import audit
from bench.replica_faults import alive
from controlplane.fleet.models import Replica
from tests.bench.conftest import REPLICA_URL, replica_reporter, wait_dead
from tests.controlplane.factories import ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker
from tests.integration.conftest import Process

pytestmark = pytest.mark.django_db


@pytest.fixture
def daemon(daemon, tmp_path):
    """(the stand-in daemon as the chaos run keeps its daemons, its child's pid)."""
    popen, child = daemon
    return Process(f"chaos-{popen.pid}", popen, tmp_path / "daemon.log"), child


@pytest.fixture
def run(tmp_path, daemon, monkeypatch):
    """A chaos run with one daemon and one ready replica on its worker, reported as the test says."""
    monkeypatch.setattr(chaos_module, "REPLICA_TARGET_WAIT_S", 1)
    monkeypatch.setattr(chaos_module, "REPLICA_FAILED_WAIT_S", 1)
    replica = ReplicaFactory(
        worker=make_worker(name=daemon[0].name), state=Replica.State.READY, endpoint_url=REPLICA_URL
    )
    chaos = Chaos(tmp_path, tenants=1)
    chaos.deployment, chaos.daemons = replica.deployment, [daemon[0]]

    report = replica_reporter(replica)
    return chaos, replica, report


@pytest.mark.parametrize("reported", ["no pid", "a process of no daemon", "a stopped daemon's process"])
def test_a_replica_kill_that_finds_no_replica_process_fails_the_run_and_signals_nothing(
    run, daemon, processes, reported
):
    chaos, replica, report = run
    stranger = processes(["sleep", "300"])
    if reported == "no pid":  # a daemon that does not report pids
        report()
    elif reported == "a process of no daemon":  # a pid the host gave some other process
        report(pid=stranger.pid)
    else:
        report(pid=daemon[1])
        daemon[0].popen.kill()
        daemon[0].popen.wait()
    assert chaos.replica_processes() == []

    fault = chaos.replica_kill(chaos_module.random.Random(0))
    assert fault.problem.startswith("no ready replica with a live process its daemon reported")
    assert fault.pid is None and alive(stranger.pid) and stranger.poll() is None
    result = audit([], [], fault_problems([fault]))
    assert not result.ok and result.faults_without_effect == [f"fault 1 (replica_kill): {fault.problem}"]


def test_a_replica_kill_kills_the_reported_process_and_fails_the_run_when_no_failure_is_recorded(run, daemon):
    chaos, replica, report = run
    report(pid=daemon[1])
    [target] = chaos.replica_processes()
    assert (target.replica_id, target.worker, target.pid) == (replica.pk, daemon[0].name, daemon[1])

    fault = chaos.replica_kill(chaos_module.random.Random(0))
    assert (fault.replica_id, fault.pid) == (replica.pk, daemon[1]) and wait_dead(daemon[1])
    # Nothing here is a real daemon: no one reports the replica failed, and the run says so.
    assert fault.problem == f"replica {replica.pk} was not recorded failed within 1s"
    assert not audit([], [], fault_problems([fault])).ok
