"""Helpers for the tests of bench/'s scripts."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_script():
    """bench_script(name) -> the module bench/name.py, imported as the scripts import each other
    (bench/ on sys.path, `import common`) for the test module's life."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCH))


# Where the fault tests' replicas say they serve; nothing listens there, no test calls it.
REPLICA_URL = "http://127.0.0.1:8101"
# A stand-in for a worker daemon: a process whose child stands in for its replica's process.
_DAEMON = (
    "import subprocess, sys, time; child = subprocess.Popen(['sleep', '300']); print(child.pid, flush=True); "
    "time.sleep(300)"
)


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
def daemon(processes):
    """(a stand-in daemon's Popen, its child's pid)."""
    from bench.replica_faults import alive

    popen = processes([sys.executable, "-c", _DAEMON], stdout=subprocess.PIPE, text=True)
    child = int(popen.stdout.readline())
    yield popen, child
    if alive(child):  # its daemon was stopped first
        psutil.Process(child).kill()


def wait_dead(pid: int) -> bool:
    """Whether `pid` is gone within 30 s."""
    from bench.replica_faults import alive

    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def replica_reporter(replica):
    """report(**fields): a heartbeat of the replica's worker that reports it ready, with these fields."""
    from django.utils import timezone

    from controlplane.fleet.services.heartbeats import worker_heartbeat
    from gpuworker.contract.heartbeat import parse_heartbeat

    def report(**fields):
        body = {"replica_id": replica.pk, "state": "ready", "endpoint_url": REPLICA_URL, **fields}
        worker_heartbeat(
            worker_id=replica.worker_id, heartbeat=parse_heartbeat({"replicas": [body]}), now=timezone.now()
        )

    return report
