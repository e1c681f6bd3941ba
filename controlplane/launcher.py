"""Runs the whole system in the foreground for `make run`: one child process per line below.

Each child gets its own process group, so stopping it also stops whatever it forked (Celery's
pool, for instance). A child that exits on its own is started again after a delay that doubles
with each of its exits in a row (RestartPolicy), and the launcher says which child, how it ended
and when it comes back; the others keep running. Ctrl-C or SIGTERM stops every child and exits 0.
A crash loop (a child's exits reaching RestartPolicy.crash_loop_exits within window_s) stops every
child and exits non-zero, so a set-up that cannot run never looks half alive.

    python -m controlplane.launcher [--host 127.0.0.1] [--port 8000] [--fleet-port 8001] [--env-file .env.demo]

The web server listens on this machine only (127.0.0.1) unless told otherwise (--host or
GPUSERVE_HOST): the embedded set-up has a demo login and a development secret key. The fleet
server, which the local GPU worker daemon calls (controlplane.fleet_asgi), always listens on
127.0.0.1, on --fleet-port (or FLEET_PORT).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from controlplane.demo.names import CHAT_FP8_MODEL_NAME, CHAT_MODEL_NAME
from controlplane.env import read_env_file
from controlplane.tokens import read_or_create_secret_file

BASE_DIR = Path(__file__).resolve().parent.parent
# Where the web server listens by default: loopback, so a demo set-up is not open to the network.
HOST_ENV, DEFAULT_HOST = "GPUSERVE_HOST", "127.0.0.1"
# Where the fleet server (worker daemons' registration and heartbeats) listens by default.
FLEET_PORT_ENV, DEFAULT_FLEET_PORT = "FLEET_PORT", 8001
# Children get this long to shut down cleanly after SIGTERM before they are killed.
STOP_GRACE_SECONDS = 10.0
# The GPU worker daemon bounds its own stop: its Celery consumer (<= 10 s,
# gpuworker.daemon.tasks.CONSUMER_STOP_S), the replicas' drain
# (GPUWORKER_DRAIN_S), then their stop, SIGKILLed after 10 s (gpuworker.daemon.supervisor.KILL_AFTER_S).
# Killing it sooner would leave its replicas to die with it, undrained.
GPUWORKER_DRAIN_S = 5
GPUWORKER_STOP_GRACE_S = 10.0 + GPUWORKER_DRAIN_S + 10.0 + 5.0
_POLL_SECONDS = 0.2
# How long the demo's quality check waits for the worker to report SmolLM2's checkpoint.
DEMO_QUALITY_WAIT_S = 600


@dataclass(frozen=True)
class RestartPolicy:
    # A child's first restart waits first_delay_s; each further exit within window_s doubles it,
    # up to max_delay_s. Its crash_loop_exits-th exit within window_s is a crash loop.
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    crash_loop_exits: int = 5
    window_s: float = 120.0

    def delay_s(self, recent_exits: int) -> float:
        """The wait before a restart, given the child's exits within the window (this one included)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (recent_exits - 1))


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: list[str]
    # Extra environment for this process only (over the launcher's own).
    env: dict[str, str] = field(default_factory=dict)
    # How long it gets after SIGTERM before SIGKILL.
    stop_grace_s: float = STOP_GRACE_SECONDS
    # A job that runs once to its end: its exit is reported, never restarted.
    once: bool = False


def process_specs(
    *, host: str, port: int, fleet_port: int = DEFAULT_FLEET_PORT, var_dir: Path = BASE_DIR / "var"
) -> list[ProcessSpec]:
    """The processes of the embedded system; adding one is adding a line."""

    def module(*args: str) -> list[str]:
        return [sys.executable, "-m", *args]

    # One local worker has no peers: gossip and mingle would only slow its start. The GPU worker
    # daemon registers with the fleet server (retrying until it is up), which tenant traffic on the
    # web server cannot delay; it takes the worker token from the environment main() prepares, and
    # drains within the launcher's stop grace. The control plane's processes send the live events
    # they publish to the web server's pages, by UDP on the web server's port number
    # (controlplane.live_relay).
    relay = {"LIVE_EVENTS_RELAY_PORT": str(port)}
    return [
        # No proxy headers: common.client_address alone decides whom X-Forwarded-For may name.
        ProcessSpec(
            "web",
            module(
                "uvicorn",
                "controlplane.asgi:application",
                "--host",
                host,
                "--port",
                str(port),
                "--no-proxy-headers",
            ),
            env=relay,
        ),
        ProcessSpec(
            "fleet",
            module(
                "uvicorn",
                "controlplane.fleet_asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(fleet_port),
                "--no-proxy-headers",
            ),
            env=relay,
        ),
        ProcessSpec(
            "worker",
            module(
                "celery",
                "-A",
                "controlplane",
                "worker",
                "-l",
                "INFO",
                "-c",
                "2",
                "--without-gossip",
                "--without-mingle",
            ),
            env=relay,
        ),
        # Beat sends a lost-worker check every second: at INFO it would log each one.
        ProcessSpec("beat", module("celery", "-A", "controlplane", "beat", "-l", "WARNING"), env=relay),
        ProcessSpec(
            "gpuworker",
            module(
                "gpuworker",
                "daemon",
                "--control-url",
                f"http://127.0.0.1:{fleet_port}",
                "--name",
                "local",
                "--state-dir",
                str(var_dir / "gpuworker" / "local"),
                "--drain-timeout",
                str(GPUWORKER_DRAIN_S),
                # reported to the catalog, which checks weight paths against it
                "--model-root",
                str(var_dir / "models"),
            ),
            # CPU replicas share the host with the web server and Celery: PyTorch's default
            # of one thread per core oversubscribes it (measured ~20x slower on 2 cores).
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))},
            stop_grace_s=GPUWORKER_STOP_GRACE_S,
        ),
        # The demo's quality check, once: SmolLM2 and its FP8-at-load twin measured by the local
        # worker as soon as it reports their checkpoint (one at a time, in the background).
        ProcessSpec(
            "quality",
            [
                sys.executable,
                str(BASE_DIR / "manage.py"),
                "measure_quality",
                "--unmeasured",
                "--wait",
                str(DEMO_QUALITY_WAIT_S),
                CHAT_MODEL_NAME,
                CHAT_FP8_MODEL_NAME,
            ],
            once=True,
        ),
    ]


@dataclass
class _Child:
    """One line of process_specs and its current process (None while it waits for a restart)."""

    spec: ProcessSpec
    process: subprocess.Popen | None = None
    exits: list[float] = field(default_factory=list)  # time.monotonic() of its exits within the window
    restart_at: float = 0.0


def exit_status(returncode: int) -> str:
    """A child's exit as a person reads it: `status 3`, `status -9 (SIGKILL)`."""
    if returncode < 0:
        try:
            return f"status {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"status {returncode}"


class Launcher:
    def __init__(
        self, specs: Sequence[ProcessSpec], *, out: TextIO | None = None, restart: RestartPolicy = RestartPolicy()
    ):
        self._children = [_Child(spec) for spec in specs]
        self._restart = restart
        self._out = out or sys.stdout
        self._out_lock = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self._stop_requested = threading.Event()
        self._stopping = False
        self._width = max(len(spec.name) for spec in specs)

    def say(self, text: str, *, name: str = "launcher") -> None:
        with self._out_lock:
            for line in text.splitlines() or [""]:
                self._out.write(f"{name:<{self._width}} | {line}\n")
            self._out.flush()

    def request_stop(self, signum: int, frame=None) -> None:
        if self._stopping:
            # A second Ctrl-C while stopping: do not wait for a clean shutdown any more.
            self._signal_all(signal.SIGKILL)
        self._stop_requested.set()

    def run(self, *, on_ready=None) -> int:
        """Start every child and supervise them; returns the exit status for the launcher."""
        for child in self._children:
            try:
                self._start(child)
            except OSError as exc:
                self.say(f"could not start {child.spec.name}: {exc}")
                return self._stop(1)
        ready = on_ready is None
        while not self._stop_requested.is_set():
            now = time.monotonic()
            for child in self._children:
                if child.process is not None and child.process.poll() is not None and child.spec.once:
                    self.say(f"{child.spec.name} finished with {exit_status(child.process.returncode)}")
                    child.process, child.restart_at = None, float("inf")
                elif child.process is not None and child.process.poll() is not None:
                    if not self._schedule_restart(child, now):
                        return self._stop(1)
                elif child.process is None and now >= child.restart_at:
                    try:
                        self._start(child, restart=True)
                    except OSError as exc:
                        self.say(f"could not restart {child.spec.name}: {exc}")
                        return self._stop(1)
            if not ready:
                ready = on_ready()
            self._stop_requested.wait(_POLL_SECONDS)
        self.say("stopping…")
        return self._stop(0)

    def _schedule_restart(self, child: _Child, now: float) -> bool:
        """Notes a child's exit and when it starts again; False for a crash loop."""
        name, status = child.spec.name, exit_status(child.process.returncode)
        # Whatever it forked (a Celery pool) must not outlive it: the new one starts its own.
        self._signal_group(child.process, signal.SIGKILL)
        child.process = None
        child.exits = [at for at in child.exits if now - at < self._restart.window_s] + [now]
        policy = self._restart
        if len(child.exits) >= policy.crash_loop_exits:
            self.say(
                f"{name} exited with {status}: {len(child.exits)} exits within {policy.window_s:g}s, "
                "a crash loop; stopping everything"
            )
            return False
        delay = policy.delay_s(len(child.exits))
        child.restart_at = now + delay
        self.say(
            f"{name} exited unexpectedly with {status}; restarting it in {delay:g}s "
            f"(exit {len(child.exits)} of {policy.crash_loop_exits - 1} tolerated within {policy.window_s:g}s)"
        )
        return True

    def _start(self, child: _Child, *, restart: bool = False) -> None:
        spec = child.spec
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        process = subprocess.Popen(
            spec.argv,
            cwd=BASE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        child.process = process
        self.say(f"{'restarted' if restart else 'started'} {spec.name} (pid {process.pid})")
        pump = threading.Thread(target=self._pump, args=(spec.name, process), daemon=True)
        pump.start()
        self._pumps.append(pump)

    def _pump(self, name: str, process: subprocess.Popen) -> None:
        for raw in iter(process.stdout.readline, b""):
            self.say(raw.decode("utf-8", errors="replace").rstrip("\n"), name=name)
        process.stdout.close()

    @staticmethod
    def _signal_group(process: subprocess.Popen, signum: int) -> None:
        try:
            # The group id is the child's pid (start_new_session), so this reaches its forks too.
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass

    def _running(self) -> list[tuple[ProcessSpec, subprocess.Popen]]:
        return [(child.spec, child.process) for child in self._children if child.process is not None]

    def _signal_all(self, signum: int) -> None:
        for _, process in self._running():
            self._signal_group(process, signum)

    def _stop(self, status: int) -> int:
        self._stopping = True
        running = self._running()
        # SIGTERM goes to each child alone: a Celery worker then stops its own pool in order,
        # whereas a group-wide SIGTERM would kill the pool under it mid-task.
        for _, process in running:
            if process.poll() is None:
                process.terminate()
        stopped_at = time.monotonic()
        for spec, process in running:
            try:
                process.wait(timeout=max(0.0, stopped_at + spec.stop_grace_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{spec.name} did not stop within {spec.stop_grace_s:.0f}s; killing it")
        # Sweep the groups: anything a child left behind goes now.
        self._signal_all(signal.SIGKILL)
        for _, process in running:
            process.wait()
        for pump in self._pumps:
            pump.join(timeout=2)
        self.say("all processes stopped")
        return status


def port_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def banner(*, port: int, env_file: Path, fleet_port: int = DEFAULT_FLEET_PORT) -> str:
    # Imported here: the demo module needs Django's apps, which main() sets up first.
    from controlplane.demo.seed import LOGINS, password_variable

    demo = read_env_file(env_file)
    url = f"http://127.0.0.1:{port}"
    lines = [
        "",
        f"gpuserve is up: {url}/",
        f"  dashboard: {url}/",
    ]
    if demo:
        logins = [(f"{username} / {demo.get(password_variable(username), '?')}", can) for username, _, can in LOGINS]
        width = max(len(login) for login, _ in logins)
        lines += [f"    {login:<{width}}  {can}" for login, can in logins]
        lines += [
            f"  API:       OPENAI_BASE_URL={url}/v1",
            f"             OPENAI_API_KEY={demo.get('OPENAI_API_KEY', '?')}",
            f"  metrics:   {url}/metrics (Prometheus; with the admin login, or METRICS_TOKEN as a bearer token)",
            "  models:    smollm2-135m-instruct (SmolLM2-135M-Instruct, a small real chat model), all-minilm-l6-v2",
            "             (embeddings), demo-tiny and demo-vision (takes images), loading on the local GPU worker",
            "             daemon. demo-tiny's and demo-vision's weights are random: their text is random noise,",
            "             not language.",
            f"  (saved in {env_file}; `set -a; . {env_file.name}; set +a` exports them for OpenAI clients)",
        ]
    else:
        lines += [
            f"  API:       OPENAI_BASE_URL={url}/v1",
            f"  no {env_file.name} yet: run `python manage.py seed_demo` for the logins and an API key",
        ]
    lines += [
        f"  fleet:     http://127.0.0.1:{fleet_port}/internal/ (the GPU worker daemons' registration and "
        "heartbeats, apart from tenant traffic)",
        "Press Ctrl-C to stop everything.",
        "",
    ]
    return "\n".join(lines)


def demo_environment(*, var_dir: Path) -> dict[str, str]:
    """What the children get when the environment does not set DEBUG: Django's production mode, so a
    missing page is the dashboard's 404 and never the debug page listing every route, kept to plain
    HTTP on this machine as the development defaults are (no TLS on 127.0.0.1), with a signing key
    of its own in `var_dir`. The web server serves /static/ itself either way (SERVE_STATIC)."""
    return {
        "DEBUG": "0",
        "SECRET_KEY": read_or_create_secret_file(var_dir / "secret-key"),
        "ALLOWED_HOSTS": "localhost,127.0.0.1,[::1]",
        "SECURE_SSL_REDIRECT": "0",
        "SESSION_COOKIE_SECURE": "0",
        "CSRF_COOKIE_SECURE": "0",
        "SECURE_HSTS_SECONDS": "0",
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": "0",
    }


def _settings():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django
    from django.conf import settings

    # The banner names the demo's logins, which live beside their models (controlplane.demo.seed).
    django.setup()
    return settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--host",
        default=os.environ.get(HOST_ENV, DEFAULT_HOST),
        help=f"address the web server listens on (default: ${HOST_ENV}, else {DEFAULT_HOST}: this "
        "machine only); 0.0.0.0 opens it to the network",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--fleet-port",
        type=int,
        default=int(os.environ.get(FLEET_PORT_ENV, DEFAULT_FLEET_PORT)),
        help=f"port of the fleet server the GPU worker daemon calls, on 127.0.0.1 (default: "
        f"${FLEET_PORT_ENV}, else {DEFAULT_FLEET_PORT})",
    )
    parser.add_argument("--env-file", type=Path, default=BASE_DIR / ".env.demo")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = _settings()
    # Every child gets the fleet's worker token: the daemon needs it and reads no Django settings.
    os.environ.setdefault("GPUSERVE_WORKER_TOKEN", settings.FLEET_WORKER_TOKEN)
    if "DEBUG" not in os.environ:
        for name, value in demo_environment(var_dir=settings.VAR_DIR).items():
            os.environ.setdefault(name, value)

    launcher = Launcher(
        process_specs(host=args.host, port=args.port, fleet_port=args.fleet_port, var_dir=settings.VAR_DIR)
    )
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)

    def on_ready() -> bool:
        if not (port_answers("127.0.0.1", args.port) and port_answers("127.0.0.1", args.fleet_port)):
            return False
        launcher.say(banner(port=args.port, env_file=args.env_file, fleet_port=args.fleet_port))
        return True

    return launcher.run(on_ready=on_ready)


if __name__ == "__main__":
    sys.exit(main())
