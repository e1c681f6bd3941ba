"""The embedded set-up `make run` uses, for benchmarks that go through the gateway: no PostgreSQL and
no Redis (DATABASE_URL and REDIS_URL are ignored).

A fresh VAR_DIR holds the SQLite database (migrated, then seeded through the services: a tenant
with ample credit and high limits, its key, the model and its deployment) and the file cache the
fleet's heartbeats live in. The replica is `python -m gpuworker serve` (bench.common.start_replica);
the gateway is uvicorn over controlplane.asgi. In place of the worker daemon, this process reads
the replica's /stats every heartbeat interval and records it through the fleet's own heartbeat
service (LoadReports). Where asked, a Celery worker runs the tasks (the Batch API's runner) as
`make run` starts it (the launcher's "worker" line), over the same SQLite broker under VAR_DIR.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import free_port, python_path, start_replica, stop_replica, wait_ready  # noqa: E402

TOKEN = "bench-embedded-worker-token"
# The deployment's largest objective: nothing is predicted to wait that long, so nothing is shed.
NO_OBJECTIVE_MS = 600_000


def use_embedded_control_plane(var_dir: Path) -> None:
    """This process and its children on `make run`'s set-up under var_dir: SQLite, the file cache,
    the SQLite broker."""
    for name in ("DATABASE_URL", "REDIS_URL"):
        os.environ.pop(name, None)
    os.environ |= {
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "VAR_DIR": str(var_dir),
        "GPUSERVE_WORKER_TOKEN": TOKEN,
        "LOG_LEVEL": "WARNING",
        "BATCH_STORAGE_DIR": str(var_dir / "batch-files"),
        "PYTHONPATH": python_path(ROOT),
    }
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def seed(
    *, model: str, kind: str, replica_url: str, context_length: int, ttft_slo_ms: int | None = None
) -> tuple[str, int]:
    """A tenant (ample credit, high limits) and its key, the model, its deployment with the objective
    (None: the default), and the worker whose ready replica is ours: (the key, the replica's id)."""
    from controlplane.accounts.services import api_key_create, tenant_create
    from controlplane.billing.services import credit_grant, plan_create, price_tier_create
    from controlplane.catalog.services import model_create
    from controlplane.fleet.models import Replica, Worker
    from controlplane.fleet.services.deployments import deployment_create

    plan = plan_create(
        name="bench", included_requests_per_month=0, rate_limit_per_minute=10_000_000, max_concurrent_requests=100_000
    )
    tenant = tenant_create(name="bench", plan=plan)
    credit_grant(tenant=tenant, amount=Decimal("1000000"))
    tier = price_tier_create(
        name="bench", price_per_request=Decimal("0.000001"), reference_price_per_million_tokens=Decimal("0.1")
    )
    model_create(
        public_name=model,
        family="llama",
        kind=kind,
        weights_path="/bench",
        context_length=context_length,
        parameter_count=1,
        price_tier=tier,
    )
    deployment = deployment_create(model_name=model, autoscale=False)
    if ttft_slo_ms is not None:
        set_objective(model, ttft_slo_ms)
    worker = Worker.objects.create(
        name="bench", queue_name="gpuworker.bench", advertise_host="127.0.0.1", device=Worker.Device.CPU
    )
    replica = Replica.objects.create(
        deployment=deployment, worker=worker, state=Replica.State.READY, endpoint_url=replica_url
    )
    return api_key_create(tenant=tenant, name="bench").plaintext, replica.pk


def set_objective(model: str, ttft_slo_ms: int) -> None:
    """The deployment's TTFT objective, through the service behind the dashboard's deployment form."""
    from controlplane.catalog.models import Deployment
    from controlplane.fleet.services.deployments import deployment_update

    deployment = Deployment.objects.get(model__public_name=model)
    deployment_update(
        deployment=deployment,
        desired_replicas=deployment.desired_replicas,
        min_replicas=deployment.min_replicas,
        max_replicas=deployment.max_replicas,
        keep_warm=deployment.keep_warm,
        ttft_slo_ms=ttft_slo_ms,
    )


class LoadReports:
    """The worker daemon's heartbeat, for our one replica: its /stats as the daemon reports them
    (supervisor.Replica.report), parsed as the fleet server parses them and recorded by the fleet's
    heartbeat service, every heartbeat interval, in a thread."""

    def __init__(self, replica_id: int, replica_url: str, model_path: str, served_model: str) -> None:
        from django.conf import settings

        from controlplane.fleet.models import Replica

        self.replica_id, self.replica_url, self.model_path = replica_id, replica_url, model_path
        self.served_model = served_model
        self.worker_id = Replica.objects.get(pk=replica_id).worker_id
        self.interval_s = settings.FLEET_HEARTBEAT_INTERVAL_SECONDS
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="load-reports", daemon=True)

    def __enter__(self) -> LoadReports:
        self.send()  # the first report is in before any request
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()

    def send(self) -> None:
        import httpx
        from django.db import close_old_connections
        from django.utils import timezone

        from controlplane.fleet.services.heartbeats import worker_heartbeat
        from gpuworker.contract.heartbeat import Heartbeat, parse_heartbeat
        from gpuworker.contract.tasks import LoadModel
        from gpuworker.daemon.supervisor import Replica

        auth = {"Authorization": f"Bearer {TOKEN}"}
        stats = httpx.get(f"{self.replica_url}/stats", headers=auth, timeout=5).json()
        load = LoadModel(
            replica_id=self.replica_id,
            model_path=self.model_path,
            served_model_name=self.served_model,
            gpu_index=None,
            memory_fraction=0.9,
        )
        report = Replica(request=load, state="ready", endpoint_url=self.replica_url, figures=stats).report()
        sent = Heartbeat(sent_at=timezone.now().isoformat(), draining=False, gpus=(), cpu={}, replicas=(report,))
        close_old_connections()
        worker_heartbeat(worker_id=self.worker_id, heartbeat=parse_heartbeat(sent.to_json()), now=timezone.now())

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.send()


def wait_idle(replica_url: str, deadline_s: float = 600.0) -> None:
    """Until the replica has nothing running or waiting (the previous run's work is done)."""
    import httpx

    auth = {"Authorization": f"Bearer {TOKEN}"}
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        stats = httpx.get(f"{replica_url}/stats", headers=auth, timeout=5).json()
        if not stats.get("running") and not stats.get("waiting"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the replica still had work after {deadline_s:.0f} s")


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "LOG_LEVEL": "WARNING", "PYTHONPATH": python_path(ROOT), **(env or {})}
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start_gateway(port: int, processes: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--workers", str(processes), "--log-level", "warning", "--no-access-log"]
    return _start(argv, log)


def start_celery_worker(gateway_port: int, log: Path) -> subprocess.Popen:
    """The Celery worker exactly as `make run` starts it (the launcher's "worker" line), on the SQLite
    broker under this process's VAR_DIR."""
    from controlplane.launcher import process_specs

    (worker,) = (s for s in process_specs(host="127.0.0.1", port=gateway_port) if s.name == "worker")
    return _start(worker.argv, log, worker.env)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process alone (a Celery worker then stops its pool in order), then whatever is
    left of its group goes."""
    stop_replica(process)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_gateway(
    process: subprocess.Popen, url: str, key: str, model: str, log: Path, deadline_s: float = 120.0
) -> None:
    """Until the gateway lists the model to the key (its routing table has the replica)."""
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}; see {log}")
        try:
            listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2)
            if listed.status_code == 200 and any(m["id"] == model for m in listed.json()["data"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not route {model} within {deadline_s:.0f} s; see {log}")


@dataclass(frozen=True)
class System:
    """The running set-up: the gateway's base URL, the tenant's key, the replica's URL and id."""

    url: str
    key: str
    replica_url: str
    replica_id: int


@contextmanager
def embedded_system(
    model_path: Path,
    *,
    workdir: Path,
    served_model: str,
    kind: str,
    device: str,
    dtype: str,
    context_length: int,
    ttft_slo_ms: int,
    replica_args: tuple[str, ...] = (),
    gateway_processes: int = 1,
    celery_worker: bool = False,
    logs: Path | None = None,
) -> Iterator[System]:
    """The whole set-up under workdir (its VAR_DIR, and the servers' logs unless `logs` names
    another folder), ready and reporting load; every server stops on the way out."""
    use_embedded_control_plane(workdir / "var")
    logs = logs or workdir
    logs.mkdir(parents=True, exist_ok=True)
    replica_log = logs / "replica.log"
    replica, replica_url = start_replica(
        model_path,
        device=device,
        dtype=dtype,
        log=replica_log,
        extra_args=(
            *("--token", TOKEN, "--served-model-name", served_model, "--max-model-len", str(context_length)),
            *replica_args,
        ),
    )
    with ExitStack() as stack:
        stack.callback(stop_replica, replica)
        key, replica_id = seed(
            model=served_model,
            kind=kind,
            replica_url=replica_url,
            context_length=context_length,
            ttft_slo_ms=ttft_slo_ms,
        )
        port, gateway_log = free_port(), logs / "gateway.log"
        gateway, url = start_gateway(port, gateway_processes, gateway_log), f"http://127.0.0.1:{port}"
        stack.callback(stop_replica, gateway)  # SIGTERM, then SIGKILL past 30 s: the same for any server
        if celery_worker:
            stack.callback(stop_group, start_celery_worker(port, logs / "celery.log"))
        wait_ready(replica, replica_url, replica_log, token=TOKEN)
        stack.enter_context(LoadReports(replica_id, replica_url, str(model_path), served_model))
        wait_gateway(gateway, url, key, served_model, gateway_log)
        yield System(url=url, key=key, replica_url=replica_url, replica_id=replica_id)
