"""The chaos suite's faults (bench/chaos.py) against what they act on: a replica kill finds its
target by the pid the worker's daemon reports in its heartbeats, signals only a process of a daemon
of the run, and a fault that finds nothing to act on, or whose effect is never seen, fails the
run's audit. The whole suite over a real fleet runs in tests/integration/test_chaos.py."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from django.utils import timezone

from bench import chaos as chaos_module
from bench.chaos import Chaos, fault_problems
from bench.chaos_audit import audit
from controlplane.fleet.models import Replica
from controlplane.fleet.services import worker_heartbeat
from gpuworker.contract.heartbeat import parse_heartbeat
from tests.controlplane.factories import ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker
from tests.integration.conftest import Process

pytestmark = pytest.mark.django_db

URL = "http://127.0.0.1:8101"
# A stand-in for a worker daemon: a process whose child stands in for its replica's process.
DAEMON = "import subprocess, sys, time; child = subprocess.Popen(['sleep', '300']); print(child.pid, flush=True); " \
         "time.sleep(300)"


@pytest.fixture
def processes():
    """start(argv, **popen_arguments) -> Popen; every process started, and its children, ends with the test."""
    started = []

    def start(argv, **kwargs):
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kwargs)
        started.append((popen, psutil.Process(popen.pid)))
        return popen

    yield start
    for popen, process in started:
        for child in process.children(recursive=True) if popen.poll() is None else []:
            child.kill()
        popen.kill()
        popen.wait()


@pytest.fixture
def daemon(processes, tmp_path):
    """(the daemon, its child's pid)."""
    popen = processes([sys.executable, "-c", DAEMON], stdout=subprocess.PIPE, text=True)
    child = int(popen.stdout.readline())
    yield Process(f"chaos-{popen.pid}", popen, tmp_path / "daemon.log"), child
    if _alive(child):  # its daemon was stopped first
        psutil.Process(child).kill()


@pytest.fixture
def run(tmp_path, daemon, monkeypatch):
    """A chaos run with one daemon and one ready replica on its worker, reported as the test says."""
    monkeypatch.setattr(chaos_module, "REPLICA_TARGET_WAIT_S", 1)
    monkeypatch.setattr(chaos_module, "REPLICA_FAILED_WAIT_S", 1)
    replica = ReplicaFactory(worker=make_worker(name=daemon[0].name), state=Replica.State.READY, endpoint_url=URL)
    chaos = Chaos(tmp_path, tenants=1)
    chaos.deployment, chaos.daemons = replica.deployment, [daemon[0]]

    def report(**fields):
        body = {"replica_id": replica.pk, "state": "ready", "endpoint_url": URL, **fields}
        worker_heartbeat(worker_id=replica.worker_id, heartbeat=parse_heartbeat({"replicas": [body]}),
                         now=timezone.now())
    return chaos, replica, report


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_dead(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.parametrize("reported", ["no pid", "a process of no daemon", "a stopped daemon's process"])
def test_a_replica_kill_that_finds_no_replica_process_fails_the_run_and_signals_nothing(
        run, daemon, processes, reported):
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
    assert fault.pid is None and _alive(stranger.pid) and stranger.poll() is None
    result = audit([], [], fault_problems([fault]))
    assert not result.ok and result.faults_without_effect == [f"fault 1 (replica_kill): {fault.problem}"]


def test_a_replica_kill_kills_the_reported_process_and_fails_the_run_when_no_failure_is_recorded(run, daemon):
    chaos, replica, report = run
    report(pid=daemon[1])
    [target] = chaos.replica_processes()
    assert (target.replica_id, target.worker, target.pid) == (replica.pk, daemon[0].name, daemon[1])

    fault = chaos.replica_kill(chaos_module.random.Random(0))
    assert (fault.replica_id, fault.pid) == (replica.pk, daemon[1]) and _wait_dead(daemon[1])
    # Nothing here is a real daemon: no one reports the replica failed, and the run says so.
    assert fault.problem == f"replica {replica.pk} was not recorded failed within 1s"
    assert not audit([], [], fault_problems([fault])).ok
