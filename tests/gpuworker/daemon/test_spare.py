"""Spare replica processes (gpuworker/replica/spare.py) under the real supervisor, on CPU: a load is
handed to the waiting spare, a new spare follows, a dead spare is replaced or bypassed, a spare's
failed load reports its cause from its own log, and draining or closing the worker ends them."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from gpuworker.__main__ import build_parser
from gpuworker.contract.heartbeat import ReplicaReport
from gpuworker.contract.spare_handover import READY_LINE
from gpuworker.contract.tasks import LoadModel
from gpuworker.daemon import supervisor as supervisor_module
from gpuworker.daemon.supervisor import Supervisor
from tests.processes import children_running

TOKEN = "replica-token"
# Generous: a spare imports torch, transformers and xgrammar on a busy 2-core CI box.
START_S = 180.0


def _wait_for(condition, what: str, timeout: float = START_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def _entry(supervisor: Supervisor, replica_id: int, *states: str) -> ReplicaReport | None:
    for entry in supervisor.snapshot():
        if entry.replica_id == replica_id and (not states or entry.state in states):
            return entry
    return None


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _spares(exclude: set[int] = frozenset()) -> list[psutil.Process]:
    return [p for p in children_running("spare", argument=True) if p.pid not in exclude]


def _ready_spare(supervisor: Supervisor, exclude: set[int] = frozenset()) -> psutil.Process:
    """The one waiting spare (not in exclude), once it logged that it is ready."""
    log = supervisor.log_dir / "spare-cpu.log"

    def ready():
        spares = _spares(exclude)
        if (
            len(spares) == 1
            and log.is_file()
            and f"{READY_LINE} on cpu" in log.read_text()
            and f"pid {spares[0].pid})" in log.read_text()
        ):
            return spares[0]
        return None

    return _wait_for(ready, "a ready spare")


@pytest.fixture
def supervisor(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    others = {p.pid for p in psutil.Process().children()}
    supervisor = Supervisor(
        token=TOKEN,
        gpu_count=0,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        state_dir=tmp_path,
        worker_name="test-host",
        model_roots=(tmp_path_factory.getbasetemp(),),
        spare_replicas=True,
    )
    supervisor.start()
    yield supervisor
    supervisor.close(drain_timeout_s=5)
    # Closing the worker ends every replica and spare it started.
    assert [p for p in psutil.Process().children() if p.pid not in others and _alive(p)] == []


def _load(supervisor: Supervisor, replica_id: int, model_path) -> None:
    supervisor.load(
        LoadModel(
            replica_id=replica_id,
            model_path=str(model_path),
            served_model_name="tiny",
            gpu_index=None,
            memory_fraction=0.5,
            max_model_len=128,
        )
    )


@pytest.mark.slow
def test_a_load_is_handed_to_the_spare_and_the_next_spare_follows(supervisor, tiny_checkpoint, monkeypatch):
    spare = _ready_spare(supervisor)
    _load(supervisor, 1, tiny_checkpoint("llama"))
    ready = _wait_for(lambda: _entry(supervisor, 1, "ready", "failed"), "replica 1 ready or failed")
    assert ready.state == "ready", ready.error
    assert ready.pid == spare.pid  # reported as the replica's process: what the chaos suite kills
    # The spare's process is the replica: it listens on the replica's port (the socket the daemon bound).
    port = int(ready.endpoint_url.rsplit(":", 1)[1])
    assert port in {c.laddr.port for c in spare.net_connections() if c.status == psutil.CONN_LISTEN}
    completion = httpx.post(
        f"{ready.endpoint_url}/v1/completions",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True},
        timeout=60,
    )
    assert completion.status_code == 200 and completion.json()["model"] == "tiny"
    # Its output after the hand-over went to the replica's log, not the spare's.
    assert "model tiny ready" in (supervisor.log_dir / "replica-1.log").read_text()
    assert "model tiny ready" not in (supervisor.log_dir / "spare-cpu.log").read_text()

    # The load is done: a new spare starts, and one that dies is replaced.
    monkeypatch.setattr(supervisor_module, "SPARE_RETRY_S", 0.0)
    second = _ready_spare(supervisor, exclude={spare.pid})
    second.kill()
    third = _ready_spare(supervisor, exclude={spare.pid, second.pid})
    assert third.pid != second.pid

    # Draining the worker (no new loads) ends the waiting spare; the replica is not touched.
    supervisor.refuse_loads = True
    _wait_for(lambda: not _alive(third), "the spare stopped", 30)
    assert _entry(supervisor, 1, "ready")


@pytest.mark.slow
def test_a_dead_spare_is_bypassed_and_a_failed_load_in_a_spare_reports_its_cause(
    supervisor, tiny_checkpoint, unreadable_checkpoint
):
    # The spare is killed just before a load: the load starts a fresh `serve` process instead
    # (the supervisor waits SPARE_RETRY_S before starting another spare).
    spare = _ready_spare(supervisor)
    os.kill(spare.pid, signal.SIGKILL)
    _load(supervisor, 2, tiny_checkpoint("llama"))
    ready = _wait_for(lambda: _entry(supervisor, 2, "ready", "failed"), "replica 2 ready or failed")
    assert ready.state == "ready", ready.error
    assert children_running("serve", argument=True)

    # A load that fails inside a spare reports the replica's own error, then its log.
    supervisor.unload(2, drain_timeout_s=1)
    _wait_for(lambda: _entry(supervisor, 2, "stopped"), "replica 2 stopped", 60)
    spare = _ready_spare(supervisor, exclude={spare.pid})  # SPARE_RETRY_S after the dead one started
    broken = unreadable_checkpoint
    _load(supervisor, 3, broken)
    failed = _wait_for(lambda: _entry(supervisor, 3, "failed"), "replica 3 failed", 60)
    assert failed.error.split("\n")[0].startswith("ValueError: model.safetensors is not a safetensors file"), (
        failed.error
    )
    assert "Traceback (most recent call last):" in failed.error
    _wait_for(lambda: not _alive(spare), "the failed replica stopped", 30)


def test_spare_replicas_are_on_by_default_and_can_be_turned_off():
    base = ["daemon", "--control-url", "http://cp", "--token", "t"]
    assert build_parser().parse_args(base).spare_replicas is True
    assert build_parser().parse_args([*base, "--no-spare-replicas"]).spare_replicas is False
    assert build_parser().parse_args([*base, "--no-spare"]).spare_replicas is False
