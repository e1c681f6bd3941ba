"""A real fleet for integration tests: the control plane's HTTP servers (uvicorn: the public one and
the fleet server the daemons call) and a Celery worker with beat as subprocesses on the test
database and the real Redis broker, and real `python -m gpuworker daemon` processes on CPU, which
start real replica servers for tiny models.

Each test gets its own fleet; worker names are unique, so their Celery queues never meet another
run's. The control plane's Celery worker consumes the default queue of the test's Redis.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection

REPO = Path(__file__).resolve().parents[2]
# How long a daemon lets its replicas' streams finish when it unloads them (see start_daemon).
DRAIN_TIMEOUT_S = 60
# Fast enough to test within seconds, slow enough for a loaded two-core CI machine.
FLEET_ENV = {
    # Not the 3 s default: on a busy 2-core CI box a heartbeat can lag seconds behind, and a worker
    # marked lost fails its replicas in the middle of a test about something else.
    "FLEET_WORKER_LOST_AFTER_SECONDS": "10",
    "FLEET_RECONCILE_INTERVAL_SECONDS": "2",
    "FLEET_REPLICA_ACK_TIMEOUT_SECONDS": "60",
    "FLEET_UNLOAD_DRAIN_TIMEOUT_SECONDS": "60",
    # A failed load is retried on its worker after 2 s, then 4 s, capped at 8 s.
    "FLEET_LOAD_RETRY_INITIAL_SECONDS": "2",
    "FLEET_LOAD_RETRY_MAX_SECONDS": "8",
}
# The processes of the control plane (the rest are daemons).
CONTROL_PLANE = ("web", "fleet", "celery")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def wait_until(predicate: Callable[[], object], *, timeout: float, what: str, fleet: "Fleet | None" = None):
    """Poll until `predicate()` is truthy and return its value; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = fleet.logs() if fleet is not None else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}", pytrace=False)
        time.sleep(0.2)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path


class Fleet:
    def __init__(self, tmp_path: Path, redis_url: str) -> None:
        db = connection.settings_dict
        database_url = (
            f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
        )
        self.tmp_path = tmp_path
        self.token = settings.FLEET_WORKER_TOKEN
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.fleet_url = f"http://127.0.0.1:{_free_port()}"
        self.env = {
            **os.environ,
            **FLEET_ENV,
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "DEBUG": "1",
            "VAR_DIR": str(tmp_path / "var"),
            "GPUSERVE_WORKER_TOKEN": self.token,
            "PYTHONUNBUFFERED": "1",
        }
        (tmp_path / "var").mkdir()
        self.processes: list[Process] = []

    def _start(self, name: str, argv: list[str], *, mode: str = "wb") -> Process:
        log_path = self.tmp_path / f"{name}.log"
        with open(log_path, mode) as log:
            popen = subprocess.Popen(
                [sys.executable, *argv],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = Process(name, popen, log_path)
        self.processes.append(process)
        return process

    def start_control_plane(self, *, mode: str = "wb") -> None:
        for name, argv in self.servers().items():
            self._start(name, argv, mode=mode)
        self._start(
            "celery",
            [
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "--beat",
                "-l",
                "INFO",
                "-c",
                "2",
                "--without-gossip",
                "--without-mingle",
            ],
            mode=mode,
        )
        for url in (self.url, self.fleet_url):
            wait_until(lambda: self._answers(url), timeout=60, what=f"{url}/healthz", fleet=self)

    def servers(self) -> dict[str, list[str]]:
        """The web and fleet servers' command lines as `make run` has them (launcher.process_specs:
        ASGI lifespan on, so the gateway starts with its process), without access lines."""
        from controlplane.launcher import process_specs

        specs = process_specs(host="127.0.0.1", port=self.port, fleet_port=int(self.fleet_url.rsplit(":", 1)[1]))
        return {spec.name: [*spec.argv[1:], "--no-access-log"] for spec in specs if spec.name in ("web", "fleet")}

    def stop_control_plane(self) -> None:
        """Stop the web servers and Celery (worker and beat), as a restart or an upgrade would:
        only the database and the broker carry anything over to the next start."""
        for process in [p for p in self.processes if p.name in CONTROL_PLANE]:
            self._stop_process(process)
            self.processes.remove(process)

    def restart_control_plane(self) -> None:
        self.stop_control_plane()
        self.start_control_plane(mode="ab")  # the logs go on

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start_daemon(self, label: str) -> Process:
        name = f"it-{uuid.uuid4().hex[:8]}-{label}"
        # No --port-range: the daemon binds each replica's socket on a port the OS chooses and hands
        # it to the child, so no other process of a busy machine can take it first. The drain waits
        # only for the streams in flight, so its limit can be generous: a drain that runs out ends
        # them with an error, and on a loaded CI machine a 300-token stream took 14 s (10 s failed).
        return self._start(
            name,
            [
                "-m",
                "gpuworker",
                "daemon",
                "--control-url",
                self.fleet_url,
                "--name",
                name,
                "--device",
                "cpu",
                "--advertise-host",
                "127.0.0.1",
                "--state-dir",
                str(self.tmp_path / name),
                "--drain-timeout",
                str(DRAIN_TIMEOUT_S),
            ],
        )

    def kill(self, process: Process) -> None:
        """SIGKILL, as a crash would: the daemon gets no chance to drain or say goodbye."""
        os.kill(process.popen.pid, signal.SIGKILL)
        process.popen.wait(timeout=10)

    def restart(self, process: Process) -> Process:
        """Start a stopped process again with the same command line (a daemon keeps its name and
        state folder, so it registers as the same worker)."""
        self.processes.remove(process)
        return self._start(process.name, process.popen.args[1:], mode="ab")  # its log goes on

    def stop(self) -> None:
        # Daemons first (they drain their replicas), then Celery and the web server.
        for process in sorted(self.processes, key=lambda p: p.name in CONTROL_PLANE):
            self._stop_process(process)

    @staticmethod
    def _stop_process(process: Process) -> None:
        popen = process.popen
        replicas = _children_of(popen.pid) if popen.poll() is None else []
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(popen.pid, signal.SIGKILL)  # whatever it forked (Celery's pool)
        except ProcessLookupError:
            pass
        popen.wait()
        for pid in replicas:  # replica servers run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def logs(self, tail: int = 4000) -> str:
        parts = []
        for process in self.processes:
            text = process.log_path.read_text(errors="replace") if process.log_path.exists() else ""
            parts.append(f"----- {process.name} (exit {process.popen.poll()}) -----\n{text[-tail:]}")
        for log in self.tmp_path.glob("*/replicas/*.log"):
            parts.append(f"----- {log.name} -----\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)


@pytest.fixture
def fleet(transactional_db, require_postgres, redis_url, tmp_path, tmp_path_factory):
    fleet = Fleet(tmp_path, redis_url)
    # Daemons load only from their model roots: the session's temporary folder holds tiny_model_path.
    fleet.env["GPUSERVE_MODEL_ROOTS"] = str(tmp_path_factory.getbasetemp())
    try:
        fleet.start_control_plane()
        yield fleet
    finally:
        fleet.stop()
        # The subprocesses' connections are gone; ours is closed so the database can be flushed.
        connection.close()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    from gpuworker.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("models") / "tiny", max_position_embeddings=512)
