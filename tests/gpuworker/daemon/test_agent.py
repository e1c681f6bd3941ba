"""The daemon end to end: a real `python -m gpuworker daemon` process, real replica children on CPU,
Celery tasks sent through the real Redis, and a loopback fake of the control plane's HTTP API
(tests/gpuworker/daemon/control_plane_fake.py) that checks the token and every payload strictly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psutil
import pytest
import redis
from celery import Celery

from gpuworker.daemon.tasks import DRAIN_WORKER, LOAD_MODEL, UNLOAD_MODEL
from tests.conftest import require_service
from tests.gpuworker.daemon.control_plane_fake import ControlPlaneFake
from tests.gpuworker.streaming import stream_in_thread
from tests.processes import children_running

TOKEN = "fleet-worker-token"
REDIS_DB = 11  # apart from the other suites' databases


@pytest.fixture(scope="module")
def broker_url() -> str:
    url = os.environ.get("REDIS_URL", "")
    if not url:
        require_service("REDIS_URL is not set")
    return urlunsplit(urlsplit(url)._replace(path=f"/{REDIS_DB}"))


class Daemon:
    def __init__(self, fake: ControlPlaneFake, process: subprocess.Popen, log: Path, name: str, broker_url: str):
        self.fake, self.process, self.log, self.name = fake, process, log, name
        self.celery = Celery(broker=broker_url)

    def send(self, task: str, *args, **kwargs) -> None:
        self.celery.send_task(task, args=args, kwargs=kwargs, queue=self.fake.queue_of(self.name))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def serve_children(self) -> list[psutil.Process]:
        return children_running("serve", self.process.pid, argument=True)


@contextmanager
def running_daemon(
    tmp_path: Path, broker_url: str, model_root: Path, refuse_registrations: int = 0, spares: bool = False
):
    name = f"test-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k != "GPUSERVE_WORKER_TOKEN"}
    # Tiny models gain nothing from threads, and OpenMP threads spinning on a busy 2-core machine
    # make a replica 20 times slower.
    env["OMP_NUM_THREADS"] = "1"
    with ControlPlaneFake(token=TOKEN, broker_url=broker_url) as fake:
        fake.refuse_registrations = refuse_registrations
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpuworker",
                    "daemon",
                    "--control-url",
                    fake.url,
                    "--token",
                    TOKEN,
                    # No --port-range: replicas get any free port, bound by the daemon (no clash possible).
                    "--name",
                    name,
                    "--device",
                    "cpu",
                    "--state-dir",
                    str(tmp_path / name),
                    "--drain-timeout",
                    "5",
                    # the session's temporary folder: it holds every tiny checkpoint
                    "--model-root",
                    str(model_root),
                    # Off unless asked for: these tests tell replicas by their `serve` command line.
                    "--spare-replicas" if spares else "--no-spare-replicas",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        daemon = Daemon(fake, process, log, name, broker_url)
        try:
            fake.wait_for(fake.latest, timeout=30, what="the first heartbeat")
            yield daemon
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            daemon.celery.close()
            client = redis.Redis.from_url(broker_url)
            for key in client.scan_iter(f"*{name}*"):
                client.delete(key)
            client.close()
    assert fake.errors == [], fake.errors


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, broker_url):
    with running_daemon(tmp_path_factory.mktemp("daemon"), broker_url, tmp_path_factory.getbasetemp()) as running:
        yield running
    assert "Traceback" not in running.log_text()


def _load_kwargs(replica_id: int, model_path, **overrides) -> dict:
    return {
        "replica_id": replica_id,
        "model_path": str(model_path),
        "served_model_name": "tiny",
        "gpu_index": None,
        "memory_fraction": 0.5,
        "max_model_len": 1024,
        **overrides,
    }


def _states(fake: ControlPlaneFake, replica_id: int) -> list[str]:
    """The replica's states over every heartbeat so far, repeats folded."""
    states: list[str] = []
    with fake.lock:
        beats = [body for _, body in fake.heartbeats]
    for body in beats:
        for entry in body["replicas"]:
            if entry["replica_id"] == replica_id and (not states or states[-1] != entry["state"]):
                states.append(entry["state"])
    return states


def test_registers_and_heartbeats_in_the_contract_shape(daemon):
    [registration] = daemon.fake.registrations
    assert registration["name"] == daemon.name and registration["device"] == "cpu" and registration["gpus"] == []
    assert registration["advertise_host"] == "127.0.0.1" and registration["cpu"]["cores"] >= 1
    count = len(daemon.fake.heartbeats)
    daemon.fake.wait_for(lambda: len(daemon.fake.heartbeats) >= count + 3, timeout=5, what="3 more heartbeats")
    assert daemon.fake.latest()["draining"] is False and daemon.fake.errors == []


def test_bad_task_arguments_are_rejected_with_a_logged_reason(daemon, tiny_checkpoint):
    daemon.send(LOAD_MODEL, 5, "/x")
    daemon.send(LOAD_MODEL, **_load_kwargs("five", "/x"))
    daemon.send(LOAD_MODEL, replica_id=5)
    daemon.send(LOAD_MODEL, **_load_kwargs(5, "/x", memory_fraction=1.5))
    daemon.send(LOAD_MODEL, **_load_kwargs(5, "/x", colour="blue"))
    daemon.send(UNLOAD_MODEL, replica_id=5, drain_timeout_s="soon")
    daemon.send(DRAIN_WORKER, timeout_s=-1)
    # A wrong model path is a good task with a bad outcome: reported failed with the reason. The
    # daemon's --model-root confines loads: a path outside it fails before anything is read.
    daemon.send(LOAD_MODEL, **_load_kwargs(6, "/no/such/model"))
    failed = daemon.fake.wait_for(lambda: daemon.fake.replica(6, "failed"), timeout=15, what="replica 6 failed")
    assert failed["error"].startswith("model path /no/such/model lies outside this worker's model roots (")
    assert failed["endpoint_url"] == ""
    log = daemon.log_text()
    for reason in (
        "rejected gpuworker.load_model: takes keyword arguments only, got 2 positional argument(s)",
        "rejected gpuworker.load_model: replica_id must be an integer >= 0, got 'five'",
        "rejected gpuworker.load_model: model_path is required",
        "rejected gpuworker.load_model: memory_fraction must be a number in (0, 1], got 1.5",
        "rejected gpuworker.load_model: unexpected argument(s) colour",
        "rejected gpuworker.unload_model: drain_timeout_s must be a number in [0, 3600], got 'soon'",
        "rejected gpuworker.drain_worker: timeout_s must be a number in [0, 3600], got -1",
    ):
        assert reason in log
    assert "Traceback" not in log and "retry" not in log.lower()
    assert daemon.process.poll() is None and daemon.fake.latest()["draining"] is False
    assert _states(daemon.fake, 5) == [] and daemon.serve_children() == []


def test_reregisters_when_a_heartbeat_gets_404(daemon):
    registrations = len(daemon.fake.registrations)
    daemon.fake.answer_404 = 1
    daemon.fake.wait_for(lambda: len(daemon.fake.registrations) > registrations, timeout=30, what="a new registration")
    assert daemon.fake.answer_404 == 0  # the 404 was answered, and what followed it was a registration
    assert daemon.fake.registrations[-1]["name"] == daemon.name
    count = len(daemon.fake.heartbeats)
    daemon.fake.wait_for(lambda: len(daemon.fake.heartbeats) > count, timeout=30, what="heartbeats again")
    with daemon.fake.lock:
        worker_id, _ = daemon.fake.heartbeats[-1]
    assert worker_id == daemon.fake.workers[daemon.name]  # under the id the new registration answered
    assert "does not know worker id" in daemon.log_text() and "registering again" in daemon.log_text()


@pytest.mark.slow
def test_load_serve_and_unload_with_a_stream_in_flight(daemon, tiny_checkpoint):
    kwargs = _load_kwargs(1, tiny_checkpoint("llama"))
    daemon.send(LOAD_MODEL, **kwargs)
    daemon.send(LOAD_MODEL, **kwargs)  # repeated while loading: changes nothing
    ready = daemon.fake.wait_for(lambda: daemon.fake.replica(1, "ready"), timeout=60, what="replica 1 ready")
    endpoint = ready["endpoint_url"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{endpoint}/v1/completions", json={"prompt": "x"}).status_code == 401
    completion = httpx.post(
        f"{endpoint}/v1/completions",
        headers=auth,
        timeout=30,
        json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True},
    )
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
    daemon.send(LOAD_MODEL, **kwargs)  # repeated while ready: changes nothing
    [child] = daemon.serve_children()

    thread, result = stream_in_thread(
        f"{endpoint}/v1/completions",
        {"prompt": "go", "max_tokens": 500, "stream": True, "ignore_eos": True, "logprobs": 0},
        TOKEN,
    )
    assert result["first"].wait(10)
    daemon.send(UNLOAD_MODEL, replica_id=1, drain_timeout_s=60)  # ample, even on a busy machine
    deadline = time.monotonic() + 10
    while (
        httpx.post(f"{endpoint}/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 1}).status_code != 503
    ):
        assert time.monotonic() < deadline, "the replica never started draining"
        time.sleep(0.02)
    assert thread.is_alive()  # new requests are refused while the stream in flight goes on
    thread.join(60)
    events = result["events"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    # Every token came (a chunk may hold several when the stream fell behind): one logprob each.
    assert sum(len(c["logprobs"]["tokens"]) for e in events[:-1] for c in e["choices"]) == 500

    stopped = daemon.fake.wait_for(lambda: daemon.fake.replica(1, "stopped"), timeout=30, what="replica 1 stopped")
    assert stopped["error"] == ""
    assert _states(daemon.fake, 1) == ["loading", "ready", "draining", "stopped"]
    assert not child.is_running() and daemon.serve_children() == []
    assert daemon.log_text().count("replica 1: started pid") == 1
    with daemon.fake.lock:
        progress = [
            e["load_progress"] for _, b in daemon.fake.heartbeats for e in b["replicas"] if e["replica_id"] == 1
        ]
    assert progress == sorted(progress[: progress.index(1.0)]) + progress[progress.index(1.0) :]
    with daemon.fake.lock:  # the engine's figures travel in heartbeats while it serves the stream
        busy = [e for _, b in daemon.fake.heartbeats for e in b["replicas"] if e["replica_id"] == 1 and e["running"]]
    assert busy and all(e["running"] == 1 and e["kv_cache_usage"] > 0 for e in busy)
    assert any(e["tokens_per_s"] > 0 for e in busy)
    # So do its recent latencies, once it has samples in its window (absent, never 0, before: on a
    # slow machine the completion above may have left the window before the stream's first gap).
    timed = [e for e in busy if "itl_p95_s" in e]
    assert timed and all(e["ttft_p95_s"] > 0 and e["itl_p95_s"] > 0 for e in timed)


def test_replicas_named_in_a_heartbeat_answer_are_unloaded(daemon, tiny_checkpoint):
    daemon.send(LOAD_MODEL, **_load_kwargs(30, tiny_checkpoint("llama")))
    daemon.fake.wait_for(lambda: daemon.fake.replica(30), timeout=15, what="replica 30 reported")
    daemon.fake.unload.add(30)
    stopped = daemon.fake.wait_for(lambda: daemon.fake.replica(30, "stopped"), timeout=20, what="replica 30 stopped")
    port = stopped["endpoint_url"].rsplit(":", 1)[1]
    assert not [p for p in daemon.serve_children() if port in p.cmdline()]


@pytest.mark.slow
def test_sigterm_drains_and_stops_every_child(tmp_path, tmp_path_factory, broker_url, tiny_checkpoint):
    with running_daemon(tmp_path, broker_url, tmp_path_factory.getbasetemp()) as daemon:
        daemon.send(LOAD_MODEL, **_load_kwargs(1, tiny_checkpoint("llama")))
        daemon.send(LOAD_MODEL, **_load_kwargs(2, tiny_checkpoint("llama")))
        daemon.fake.wait_for(lambda: daemon.fake.replica(1, "ready"), timeout=60, what="replica 1 ready")
        children = daemon.serve_children()
        assert len(children) == 2
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(timeout=30) == 0
        assert not any(child.is_running() for child in children)
        last = daemon.fake.latest()
        assert last["draining"] is True and {e["state"] for e in last["replicas"]} == {"stopped"}
        assert "Traceback" not in daemon.log_text()


def test_drain_worker_unloads_everything_and_refuses_new_loads(tmp_path, tmp_path_factory, broker_url, tiny_checkpoint):
    with running_daemon(tmp_path, broker_url, tmp_path_factory.getbasetemp(), refuse_registrations=2) as daemon:
        # Registration was retried with backoff until the control plane answered.
        assert len(daemon.fake.registrations) == 1
        assert daemon.log_text().count("/internal/workers/register answered 503") == 2
        daemon.send(LOAD_MODEL, **_load_kwargs(1, tiny_checkpoint("llama")))
        daemon.fake.wait_for(lambda: daemon.fake.replica(1), timeout=15, what="replica 1 reported")
        daemon.send(DRAIN_WORKER, timeout_s=5)
        daemon.fake.wait_for(lambda: daemon.fake.latest()["draining"], timeout=5, what="draining: true")
        daemon.fake.wait_for(lambda: daemon.fake.replica(1, "stopped"), timeout=20, what="replica 1 stopped")
        daemon.send(LOAD_MODEL, **_load_kwargs(2, tiny_checkpoint("llama")))
        failed = daemon.fake.wait_for(lambda: daemon.fake.replica(2, "failed"), timeout=10, what="replica 2 failed")
        assert failed["error"] == f"worker {daemon.name} is draining and takes no new loads"
        assert daemon.serve_children() == [] and daemon.process.poll() is None


@pytest.mark.slow
def test_replicas_stop_when_the_daemon_is_killed(tmp_path, tmp_path_factory, broker_url, tiny_checkpoint):
    """A SIGKILLed daemon cannot drain; its children notice (parent-death signal) and stop themselves."""
    with running_daemon(tmp_path, broker_url, tmp_path_factory.getbasetemp()) as daemon:
        daemon.send(LOAD_MODEL, **_load_kwargs(1, tiny_checkpoint("llama")))
        daemon.fake.wait_for(lambda: daemon.serve_children(), timeout=15, what="a replica process")
        [child] = daemon.serve_children()
        # Its server answers (progress reported, or ready): SIGTERM now reaches the drain handler.
        daemon.fake.wait_for(
            lambda: (entry := daemon.fake.replica(1)) and (entry["load_progress"] > 0 or entry["state"] == "ready"),
            timeout=60,
            what="replica 1's server answering",
        )
        daemon.process.kill()
        daemon.process.wait()
        child.wait(timeout=30)  # raises psutil.TimeoutExpired if it outlives its daemon
        assert not child.is_running()
        # Stopped by the parent-death signal, which the replica takes as a drain, not killed outright.
        assert "draining:" in (tmp_path / daemon.name / "replicas" / "replica-1.log").read_text()


@pytest.mark.slow
def test_with_spares_a_load_runs_in_the_spare_and_all_stop_when_the_daemon_is_killed(
    tmp_path, tmp_path_factory, broker_url, tiny_checkpoint
):
    """The real daemon with spare replicas: the load runs in the process that was waiting for it, a
    new spare follows, and a SIGKILLed daemon takes both with it (parent-death signal)."""
    with running_daemon(tmp_path, broker_url, tmp_path_factory.getbasetemp(), spares=True) as daemon:

        def spares() -> list[psutil.Process]:
            return children_running("spare", daemon.process.pid)

        first = daemon.fake.wait_for(lambda: spares(), timeout=30, what="a spare process")[0]
        daemon.send(LOAD_MODEL, **_load_kwargs(1, tiny_checkpoint("llama")))
        ready = daemon.fake.wait_for(lambda: daemon.fake.replica(1, "ready"), timeout=180, what="replica 1 ready")
        port = int(ready["endpoint_url"].rsplit(":", 1)[1])
        assert port in {c.laddr.port for c in first.net_connections() if c.status == psutil.CONN_LISTEN}
        assert daemon.serve_children() == []  # no process was started for the load
        second = daemon.fake.wait_for(
            lambda: [p for p in spares() if p.pid != first.pid], timeout=60, what="the next spare"
        )[0]
        daemon.process.kill()
        daemon.process.wait()
        for child in (first, second):
            child.wait(timeout=60)  # raises psutil.TimeoutExpired if it outlives its daemon
        assert "draining:" in (tmp_path / daemon.name / "replicas" / "replica-1.log").read_text()
