"""The GPU worker daemon: registers the host with the control plane, heartbeats about every second,
and consumes its own Celery queue of load/unload/drain commands, which the replica supervisor runs,
and of quality measurements (quality_runs).

    python -m gpuworker daemon --control-url http://cp:8000 --token TOKEN --name host-a --model-root /models

Models load only from inside the --model-root folders; a daemon without one refuses every load.

SIGTERM or SIGINT drains every replica (bounded by --drain-timeout), stops the children, exits 0.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from gpuworker.contract.heartbeat import GpuSpec, Heartbeat, ModelPaths, WorkerRegistration
from gpuworker.contract.quality import QualityProgress
from gpuworker.contract.tasks import DrainWorker, LoadModel, MeasureQuality, StageWeights, UnloadModel
from gpuworker.daemon.hardware import HardwareError, HardwareProbe
from gpuworker.daemon.model_paths import MODEL_ROOTS_ENV, scan_model_roots
from gpuworker.daemon.quality_runs import QualityRuns
from gpuworker.daemon.staging import WeightStager
from gpuworker.daemon.supervisor import Supervisor
from gpuworker.daemon.tasks import CeleryConsumer, build_celery_app, register_tasks

logger = logging.getLogger(__name__)

REGISTER_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
FAILURE_LOG_EVERY_S = 30.0  # repeated heartbeat failures are logged this often, not every second
MODEL_SCAN_EVERY_S = 10.0  # how soon a checkpoint copied under a model root is reported
# A measurement's progress is posted again after these pauses while the control plane cannot take it.
QUALITY_REPORT_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class AgentConfig:
    control_url: str
    token: str
    name: str
    advertise_host: str | None
    device: str
    state_dir: Path
    drain_timeout_s: float = 30.0
    # Ports replicas may listen on; None: any free port (the OS chooses).
    port_range: tuple[int, int] | None = None
    # Directories holding checkpoints: the only places models load from (none: no load succeeds),
    # and what registration and heartbeats report to the catalog.
    model_roots: tuple[Path, ...] = ()
    # Host memory (page cache) for keeping the checkpoints of likely scale-ups warm; 0: none.
    stage_budget_bytes: int = 0
    # Host memory each replica keeps as its second KV tier; 0: none.
    host_kv_cache_bytes: int = 0
    # One replica process per GPU started ahead of its load (gpuworker/replica/spare.py).
    spare_replicas: bool = True
    # Serve flags every replica gets: the host's image-fetch policy (gpuworker.__main__.image_fetch_argv).
    replica_argv: tuple[str, ...] = ()


class NotRegistered(Exception):
    """The control plane does not know our worker id (it answered 404): register again."""


class ControlPlane:
    """The control plane's /internal/workers endpoints, with the worker token."""

    def __init__(self, url: str, token: str) -> None:
        self._http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=5.0)

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        response = self._http.post(path, json=payload)
        if response.status_code == 404 and path.endswith("/heartbeat"):
            raise NotRegistered(response.text[:200])
        if response.status_code != 200:
            raise httpx.HTTPStatusError(
                f"{path} answered {response.status_code}: {response.text[:300]}",
                request=response.request,
                response=response,
            )
        body = response.json()
        if not isinstance(body, dict):
            raise ValueError(f"{path} answered {body!r}, not a JSON object")
        return body

    def register(self, registration: WorkerRegistration) -> dict[str, Any]:
        body = self._post("/internal/workers/register", registration.to_json())
        celery = body.get("celery")
        if not (
            isinstance(body.get("worker_id"), int)
            and isinstance(body.get("queue"), str)
            and isinstance(celery, dict)
            and isinstance(celery.get("broker_url"), str)
        ):
            raise ValueError(f"registration answer lacks worker_id, queue or celery.broker_url: {body!r}")
        return body

    def heartbeat(self, worker_id: int, heartbeat: Heartbeat) -> dict[str, Any]:
        return self._post(f"/internal/workers/{worker_id}/heartbeat", heartbeat.to_json())

    def quality(self, worker_id: int, measurement_id: int, progress: QualityProgress) -> dict[str, Any]:
        return self._post(f"/internal/workers/{worker_id}/quality/{measurement_id}", progress.to_json())

    def close(self) -> None:
        self._http.close()


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.draining = False
        self._stop = threading.Event()
        self._heartbeats_done = threading.Event()
        self._worker_id: int | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self._interval_s = 1.0
        self._failing_since: float | None = None
        self._last_failure_log = 0.0
        self._control = ControlPlane(config.control_url, config.token)
        self.stager = WeightStager(budget_bytes=config.stage_budget_bytes, model_roots=config.model_roots)
        self._model_scan: ModelPaths | None = None
        self._model_scan_at = 0.0
        self._model_scan_acknowledged: ModelPaths | None = None

    # -- TaskHandler: what the Celery tasks ask for -----------------------------------------------

    def load(self, task: LoadModel) -> None:
        self.supervisor.load(task)

    def unload(self, task: UnloadModel) -> None:
        self.supervisor.unload(task.replica_id, task.drain_timeout_s)

    def drain(self, task: DrainWorker) -> None:
        logger.info("draining the worker: no new loads, every replica unloaded within %.1fs", task.timeout_s)
        self.draining = self.supervisor.refuse_loads = True
        self.supervisor.unload_all(task.timeout_s)

    def stage(self, task: StageWeights) -> None:
        self.stager.stage(task)

    def measure(self, task: MeasureQuality) -> None:
        self.quality_runs.start(task)

    def _report_quality(self, measurement_id: int, progress: QualityProgress) -> None:
        """Post a measurement's progress; retried while the control plane is unreachable or busy,
        given up on when it refuses the report (400: it says why, and the log keeps it)."""
        for delay in (*QUALITY_REPORT_BACKOFF_S, None):
            try:
                self._control.quality(self._worker_id, measurement_id, progress)
                return
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code < 500:
                    logger.error("the control plane refused quality measurement %d: %s", measurement_id, exc)
                    return
                failure = exc
            except (httpx.HTTPError, ValueError) as exc:
                failure = exc
            if delay is None or self._stop.wait(delay):
                logger.error("could not report quality measurement %d: %s", measurement_id, failure)
                return

    # -- life cycle -------------------------------------------------------------------------------

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self._stop.set())
        try:
            self.probe = HardwareProbe(self.config.device)
        except HardwareError as exc:
            logger.error("%s", exc)
            return 2
        advertise_host = self.config.advertise_host or _facing_address(self.config.control_url)
        inventory = self.probe.inventory()
        self.supervisor = Supervisor(
            token=self.config.token,
            gpu_count=self.probe.gpu_count,
            gpu_memory_bytes=tuple(gpu["memory_total_bytes"] for gpu in inventory["gpus"]),
            port_range=self.config.port_range,
            advertise_host=advertise_host,
            bind_host="127.0.0.1" if _is_loopback(advertise_host) else "0.0.0.0",
            state_dir=self.config.state_dir,
            worker_name=self.config.name,
            model_roots=self.config.model_roots,
            spare_replicas=self.config.spare_replicas,
            host_kv_cache_bytes=self.config.host_kv_cache_bytes,
            replica_argv=self.config.replica_argv,
        )
        self.supervisor.start()
        self.stager.start()
        self.quality_runs = QualityRuns(
            model_roots=self.config.model_roots, gpu_count=self.probe.gpu_count, report=self._report_quality
        )
        if not self.config.model_roots:
            logger.warning(
                "no --model-root given: this worker will refuse every model load until it is "
                "started with --model-root DIR (or $%s)",
                MODEL_ROOTS_ENV,
            )
        self._registration = WorkerRegistration(
            name=self.config.name,
            advertise_host=advertise_host,
            device=self.probe.device,
            gpus=tuple(GpuSpec(**gpu) for gpu in inventory["gpus"]),
            cpu_memory_total_bytes=inventory["cpu"]["memory_total_bytes"],
            cpu_cores=inventory["cpu"]["cores"],
            version=_version(),
        )
        registration = self._register_until_answered()
        consumer = self._start(registration) if registration is not None else None
        while not self._stop.wait(0.5):
            pass
        logger.info("stopping: draining every replica (at most %.1fs)", self.config.drain_timeout_s)
        self.draining = True
        if consumer is not None:
            consumer.stop()
        self.supervisor.close(self.config.drain_timeout_s)
        self.stager.close()
        self.quality_runs.close()
        self._heartbeats_done.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=10)
        self._control.close()
        self.probe.close()
        logger.info("stopped")
        return 0

    def _start(self, registration: dict[str, Any]) -> CeleryConsumer:
        """Consume the queue named at registration, and start heartbeating."""
        queue, celery = registration["queue"], registration["celery"]
        app = build_celery_app(
            worker_name=self.config.name,
            broker_url=celery["broker_url"],
            transport_options=celery.get("broker_transport_options") or {},
            queue=queue,
        )
        register_tasks(app, self)
        consumer = CeleryConsumer(
            app, worker_name=self.config.name, queue=queue, log_level=logging.getLevelName(logging.getLogger().level)
        )
        consumer.start()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()
        logger.info("worker %s (id %d) consuming %s on %s", self.config.name, self._worker_id, queue, self.probe.device)
        return consumer

    def _register(self) -> dict[str, Any]:
        scan = self._scan_models()
        registration = self._control.register(replace(self._registration, models=scan))
        self._model_scan_acknowledged = scan
        self._worker_id = registration["worker_id"]
        self._interval_s = min(60.0, max(0.2, float(registration.get("heartbeat_interval_s", 1.0))))
        return registration

    def _register_until_answered(self) -> dict[str, Any] | None:
        """Registration, retried with backoff until it succeeds; None if we are stopped first."""
        for attempt in itertools.count():
            try:
                return self._register()
            except (httpx.HTTPError, ValueError) as exc:
                delay = REGISTER_BACKOFF_S[min(attempt, len(REGISTER_BACKOFF_S) - 1)]
                logger.warning(
                    "registration with %s failed (%s); retrying in %.1fs", self.config.control_url, exc, delay
                )
            if self._stop.wait(delay):
                return None

    def _scan_models(self, *, force: bool = True) -> ModelPaths | None:
        """The checkpoints under the model roots, scanned again when due (None without roots)."""
        if not self.config.model_roots:
            return None
        now = time.monotonic()
        if force or self._model_scan is None or now - self._model_scan_at >= MODEL_SCAN_EVERY_S:
            self._model_scan, self._model_scan_at = scan_model_roots(self.config.model_roots), now
        return self._model_scan

    def _heartbeat(self) -> Heartbeat:
        sample = self.probe.sample()
        # The checkpoint list goes only when it changed since the control plane last took it.
        scan = self._scan_models(force=False)
        return Heartbeat(
            sent_at=datetime.now(timezone.utc).isoformat(),
            draining=self.draining,
            gpus=tuple(sample["gpus"]),
            cpu=sample["cpu"],
            replicas=tuple(self.supervisor.snapshot()),
            models=scan if scan is not None and scan != self._model_scan_acknowledged else None,
            staging=self.stager.report(),
        )

    def _heartbeat_loop(self) -> None:
        while True:
            started = time.monotonic()
            self._beat()
            if self._heartbeats_done.wait(max(0.0, self._interval_s - (time.monotonic() - started))):
                self._beat()  # the last one reports the replicas stopped
                return

    def _beat(self) -> None:
        try:
            heartbeat = self._heartbeat()
            answer = self._control.heartbeat(self._worker_id, heartbeat)
            if heartbeat.models is not None:
                self._model_scan_acknowledged = heartbeat.models
            self._apply(answer)
            self._failing_since = None
        except NotRegistered:
            logger.warning("the control plane does not know worker id %s; registering again", self._worker_id)
            try:
                self._register()
            except (httpx.HTTPError, ValueError) as exc:
                logger.warning("registering again failed: %s", exc)
        except (httpx.HTTPError, ValueError) as exc:
            now = time.monotonic()
            if self._failing_since is None or now - self._last_failure_log > FAILURE_LOG_EVERY_S:
                logger.warning("heartbeat failed: %s", exc)
                self._last_failure_log = now
            self._failing_since = self._failing_since or now

    def _apply(self, answer: dict[str, Any]) -> None:
        unload = answer.get("unload") or []
        if not isinstance(unload, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in unload):
            logger.warning("ignoring a heartbeat answer whose 'unload' is not a list of replica ids: %r", unload)
            return
        for replica_id in unload:
            self.supervisor.unload(replica_id, self.config.drain_timeout_s)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _facing_address(control_url: str) -> str:
    """The local address that reaches the control plane: where the gateway can likely reach us."""
    parts = urlsplit(control_url)
    host = parts.hostname or "127.0.0.1"
    try:
        address = socket.getaddrinfo(host, parts.port or 80, type=socket.SOCK_DGRAM)[0]
        with socket.socket(address[0], socket.SOCK_DGRAM) as probe:
            probe.connect(address[4])  # UDP: no packet is sent, the kernel only picks a route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _version() -> str:
    try:
        return metadata.version("gpuserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"
