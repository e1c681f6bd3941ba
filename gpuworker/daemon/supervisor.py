"""The replica supervisor: one `python -m gpuworker serve` child process per replica, and its state.

One thread owns every child (spawn, health polls, drain, SIGTERM, SIGKILL); load() and unload()
only queue commands for it, so a Celery task never waits on a model. Children are started from
that long-lived thread because they ask Linux to SIGTERM them when it dies (a SIGKILLed daemon
must not leave replicas holding ports and GPU memory).

With spare replicas on, the supervisor also keeps one spare process per GPU (one in all on a
CPU-only worker): `python -m gpuworker spare`, its imports done and its device initialised ahead of
time (gpuworker/replica/spare.py). A load on that device hands the spare its arguments, socket and
log instead of starting a process; the next spare starts once no load on that device is in
progress, so the two never compete. A spare that dies is replaced (at most once per
SPARE_RETRY_S); draining or closing the worker ends the spares.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpuworker.checkpoint_files import gguf_file, weight_bytes
from gpuworker.contract.heartbeat import REPLICA_FIGURES, REPLICA_LATENCY_FIGURES, ReplicaReport
from gpuworker.contract.placement import gpu_share_bytes, gpus_needed
from gpuworker.contract.prefix_keys import MAX_REPORTED_PREFIX_KEYS, is_prefix_key_digest
from gpuworker.contract.spare_handover import send_load
from gpuworker.contract.tasks import LoadModel
from gpuworker.daemon.model_paths import resolve_model_root_path
from gpuworker.daemon.ports import bind_replica_socket
from gpuworker.daemon.replica_errors import error_cause, failure_message

logger = logging.getLogger(__name__)

POLL_S = 0.5
# After the drain timeout the child aborts what is left; this is how long we then wait for it.
DRAIN_GRACE_S = 5.0
KILL_AFTER_S = 10.0  # after SIGTERM, before SIGKILL
FORGET_AFTER_S = 60.0  # stopped and failed replicas stay in heartbeats this long
# How much of a failed child's log is read for its cause (a traceback can be long) and its tail.
LOG_READ_CHARS = 64 * 1024
LIVE_STATES = ("loading", "ready", "draining")
# A spare process that exited (it should not) is started again at most this often.
SPARE_RETRY_S = 30.0


@dataclass
class Spare:
    """A `python -m gpuworker spare` process waiting for a load on `device`."""

    device: str
    process: subprocess.Popen
    control: socket.socket  # our end of the socket pair the load is handed over on
    started_at: float  # monotonic
    stop_deadline: float | None = None  # monotonic; SIGKILL past it, once SIGTERMed


@dataclass
class Replica:
    request: LoadModel
    state: str = "loading"
    error: str = ""
    endpoint_url: str = ""
    load_progress: float = 0.0
    figures: dict[str, float] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    log_start: int = 0  # where this process's output starts in log_path
    drain_deadline: float | None = None  # monotonic; SIGTERM once idle or past it
    kill_deadline: float | None = None  # monotonic; SIGKILL past it
    ended_at: float | None = None  # monotonic; when it became stopped or failed
    pending_load: LoadModel | None = None  # a load asked for while its failed process was stopping
    from_spare: bool = False  # its process is a spare that was handed the load
    ended_pid: int | None = None  # the process's pid once it was reaped

    def report(self) -> ReplicaReport:
        engine = self.figures if self.state in ("ready", "draining") else {}
        # A latency without a sample stays absent: 0 would read as a perfect one.
        figures = {name: engine.get(name, 0) for name in REPLICA_FIGURES if name not in REPLICA_LATENCY_FIGURES}
        figures |= {name: engine[name] for name in REPLICA_LATENCY_FIGURES if engine.get(name) is not None}
        figures["load_progress"] = self.load_progress
        return ReplicaReport(
            replica_id=self.request.replica_id,
            state=self.state,
            endpoint_url=self.endpoint_url,
            error=self.error,
            figures=figures,
            pid=self.process.pid if self.process is not None else None,
            prefix_keys=reported_prefix_keys(engine.get("prefix_keys")),
            tenant_shares=engine.get("tenant_shares") or {},
        )


class Supervisor:
    def __init__(
        self,
        *,
        token: str,
        gpu_count: int,
        advertise_host: str,
        bind_host: str,
        state_dir: Path,
        worker_name: str,
        model_roots: tuple[Path, ...],
        port_range: tuple[int, int] | None = None,
        spare_replicas: bool = False,
        gpu_memory_bytes: tuple[int, ...] = (),
        host_kv_cache_bytes: int = 0,
        replica_argv: tuple[str, ...] = (),
    ) -> None:
        # None: any free port (the OS chooses); a range only for hosts whose firewall needs one.
        self.token, self.gpu_count, self.port_range = token, gpu_count, port_range
        # Each GPU's total memory by index (() when not known): a load whose weights alone exceed
        # its GPUs' is refused before a process starts (_too_large).
        self.gpu_memory_bytes = tuple(gpu_memory_bytes)
        self.host_kv_cache_bytes = host_kv_cache_bytes
        # Loads are confined to these (a load task's path is chosen by the control plane).
        self.model_roots = tuple(model_roots)
        # Serve flags for every replica, whatever its load (the host's image-fetch policy).
        self.replica_argv = tuple(replica_argv)
        self.advertise_host, self.bind_host, self.worker_name = advertise_host, bind_host, worker_name
        self.log_dir = state_dir / "replicas"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.refuse_loads = False  # set while the worker drains
        self._replicas: dict[int, Replica] = {}
        self.spare_replicas = spare_replicas
        self._spares: dict[str, Spare] = {}  # device -> its spare
        self._spares_retired: list[Spare] = []  # stopping: SIGTERMed, not yet reaped
        self._spare_retry_at: dict[str, float] = {}  # device -> monotonic time a new spare may start
        self._commands: queue.Queue = queue.Queue()
        self._published: list[ReplicaReport] = []
        self._stopped = threading.Event()
        self._http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=1.0)
        self._thread = threading.Thread(target=self._run, name="replica-supervisor", daemon=True)

    # -- called from other threads ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def load(self, request: LoadModel) -> None:
        self._commands.put(("load", request))

    def unload(self, replica_id: int, drain_timeout_s: float) -> None:
        self._commands.put(("unload", replica_id, drain_timeout_s))

    def unload_all(self, drain_timeout_s: float) -> None:
        self._commands.put(("unload_all", drain_timeout_s))

    def snapshot(self) -> list[ReplicaReport]:
        """The heartbeat's replica reports as of the last poll."""
        return list(self._published)

    def close(self, drain_timeout_s: float) -> None:
        """Drain and stop every child (bounded by the drain timeout plus the kill delays), then stop."""
        self.refuse_loads = True
        self.unload_all(drain_timeout_s)
        self._commands.put(("close",))
        self._thread.join(timeout=drain_timeout_s + DRAIN_GRACE_S + KILL_AFTER_S + 5.0)
        self._http.close()

    # -- the supervisor thread -------------------------------------------------------------------

    def _run(self) -> None:
        closing = False
        next_poll = time.monotonic()
        while not (
            closing
            and not any(r.process for r in self._replicas.values())
            and not self._spares
            and not self._spares_retired
        ):
            try:
                command = self._commands.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                command = None
            try:
                if command is not None:
                    name, *args = command
                    if name == "close":
                        closing = True
                        self._retire_spares()
                    else:
                        getattr(self, f"_do_{name}")(*args)
                if time.monotonic() >= next_poll:
                    self._poll()
                    self._tend_spares(closing)
                    next_poll = time.monotonic() + POLL_S
            except Exception:  # one bad replica or command must not stop the supervision of the rest
                logger.exception("replica supervisor: %s failed", command or "poll")
            self._published = [r.report() for r in self._replicas.values()]

    def _do_load(self, request: LoadModel) -> None:
        current = self._replicas.get(request.replica_id)
        if current is not None and current.state in LIVE_STATES:
            if current.state == "draining":
                logger.warning("replica %d is draining; the load is ignored", request.replica_id)
            elif current.request != request:
                logger.warning(
                    "replica %d is already %s with %s; a load with other arguments is ignored",
                    request.replica_id,
                    current.state,
                    current.request,
                )
            return  # idempotent: a repeated load changes nothing
        if current is not None and current.process is not None:
            # Failed, and its process is still stopping: replacing it now would leave that process
            # unwatched (never reaped, never SIGKILLed) and beside the new one on the same GPU.
            current.pending_load = request
            logger.info("replica %d: loading again once its failed process has exited", request.replica_id)
            return
        replica = Replica(request)
        self._replicas[request.replica_id] = replica
        model_dir, problem = self._load_problem(request)
        if problem is None:
            problem = self._spawn(replica, model_dir)
        if problem is not None:
            self._end(replica, "failed", problem)
            logger.error("replica %d failed to load: %s", request.replica_id, problem)

    def _load_problem(self, request: LoadModel) -> tuple[Path | None, str | None]:
        """The resolved checkpoint (a model directory or a GGUF file), or why this load cannot work,
        found before any process starts."""
        if self.refuse_loads:
            return None, f"worker {self.worker_name} is draining and takes no new loads"
        if request.gpu_index is not None and request.gpu_index >= self.gpu_count:
            return None, (
                f"gpu_index {request.gpu_index} was requested, but this worker has no GPU"
                if not self.gpu_count
                else f"gpu_index {request.gpu_index} does not exist on this worker "
                f"(it has {self.gpu_count} GPU(s), 0-{self.gpu_count - 1})"
            )
        last_gpu = (request.gpu_index or 0) + request.tensor_parallel_size - 1
        if request.gpu_index is not None and last_gpu >= self.gpu_count:
            return None, (
                f"tensor_parallel_size {request.tensor_parallel_size} from gpu_index {request.gpu_index} "
                f"needs GPUs {request.gpu_index}-{last_gpu}; this worker has {self.gpu_count} (0-"
                f"{self.gpu_count - 1})"
            )
        resolved, problem = resolve_model_root_path(request.model_path, self.model_roots)
        if problem is not None:
            return None, problem
        path = Path(request.model_path)
        if not resolved.exists():
            return None, f"model path {path} does not exist"
        try:
            if gguf_file(resolved) is not None:
                return resolved, None
        except ValueError as exc:  # a folder holding several .gguf files
            return None, f"model path {path}: {exc}"
        if not resolved.is_dir():
            return None, f"model path {path} is not a directory or a .gguf file"
        if not (resolved / "config.json").is_file():
            return None, (
                f"model path {path} has no config.json or .gguf file "
                "(expected a Hugging Face model directory or a GGUF checkpoint)"
            )
        return resolved, self._too_large(request, resolved)

    def _too_large(self, request: LoadModel, checkpoint: Path) -> str | None:
        """Why the checkpoint's weights alone cannot fit on the GPUs the load is given (each of its
        tensor_parallel_size ranks holds 1/N, contract.placement), with the GPUs they would need;
        None when they fit, on the CPU, or when the weights' size or the GPUs' memory is not known
        (the load itself then finds out)."""
        first, size = request.gpu_index, request.tensor_parallel_size
        if first is None or len(self.gpu_memory_bytes) < first + size:
            return None
        try:
            weights = weight_bytes(checkpoint)
        except (OSError, ValueError):
            return None  # the replica's load reports an unreadable checkpoint in its own words
        gpu = min(self.gpu_memory_bytes[first : first + size])
        if gpu_share_bytes(need_bytes=weights, tensor_parallel_size=size) <= gpu:
            return None
        needed = gpus_needed(need_bytes=weights, gpu_bytes=gpu)
        gib = 1024**3
        return (
            f"model path {request.model_path}: its weights ({weights / gib:.1f} GiB) do not fit on "
            f"{size} GPU(s) of {gpu / gib:.1f} GiB (tensor_parallel_size {size}); they alone need "
            + (f"{needed} GPUs of this size" if needed else "more GPUs of this size than one host holds")
        )

    def _spawn(self, replica: Replica, model_dir: Path) -> str | None:
        request = replica.request
        device = _device(request)
        try:
            # Bound here and handed down: no other process can take the port before the child serves.
            listener = bind_replica_socket(self.bind_host, self.port_range)
        except OSError as exc:
            return f"could not bind a port for the replica on {self.bind_host}: {exc}"
        port = listener.getsockname()[1]
        # The directory checked above, not the path again: a symlink swapped since cannot redirect it.
        serve_argv = [
            "--model",
            str(model_dir),
            "--host",
            self.bind_host,
            "--port",
            str(port),
            "--device",
            device,
            "--dtype",
            request.dtype,
            "--served-model-name",
            request.served_model_name,
            "--memory-fraction",
            str(request.memory_fraction),
            "--exit-with-parent",
            str(os.getpid()),
        ]
        if request.max_model_len is not None:
            serve_argv += ["--max-model-len", str(request.max_model_len)]
        if request.allow_long_context:
            serve_argv.append("--allow-long-context")
        if self.host_kv_cache_bytes and request.tensor_parallel_size == 1:
            serve_argv += ["--host-kv-cache-bytes", str(self.host_kv_cache_bytes)]
        if request.tensor_parallel_size > 1:  # the replica starts its other ranks itself
            serve_argv += ["--tensor-parallel-size", str(request.tensor_parallel_size)]
            serve_argv += ["--expert-parallel", request.expert_parallel]
        if request.quantization:
            serve_argv += ["--quantization", request.quantization]
        serve_argv += image_limit_arguments(request) + list(self.replica_argv)
        replica.log_path = self.log_dir / f"replica-{request.replica_id}.log"
        spare = self._spares.pop(device, None)
        try:
            with open(replica.log_path, "ab") as log:
                # The log goes on across loads of one replica id: this process's part starts here.
                replica.log_start = os.fstat(log.fileno()).st_size
                if spare is not None:
                    replica.process = self._hand_to_spare(spare, serve_argv, listener, log)
                    replica.from_spare = replica.process is not None
                if replica.process is None:
                    argv = [sys.executable, "-m", "gpuworker", "serve", *serve_argv, "--fd", str(listener.fileno())]
                    replica.process = subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=self._child_env(),
                        start_new_session=True,
                        pass_fds=(listener.fileno(),),
                    )
        except OSError as exc:
            return f"could not start the replica process: {exc}"
        finally:
            listener.close()  # the child has its own copy: the port is free again once the child is gone
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        replica.endpoint_url = f"http://{host}:{port}"
        logger.info(
            "replica %d: %s pid %d on %s (%s, %s); log %s",
            request.replica_id,
            "handed to spare" if spare is not None and replica.process is spare.process else "started",
            replica.process.pid,
            replica.endpoint_url,
            request.model_path,
            device,
            replica.log_path,
        )
        return None

    def _child_env(self) -> dict[str, str]:
        # The token travels in the environment, not argv, which every local user can read in `ps`.
        # PCI bus order makes CUDA's device numbers match NVML's, which placed the replica.
        return {
            **os.environ,
            "GPUSERVE_WORKER_TOKEN": self.token,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "PYTHONUNBUFFERED": "1",
        }

    # -- spare replica processes -----------------------------------------------------------------

    def _hand_to_spare(
        self, spare: Spare, serve_argv: list[str], listener: socket.socket, log
    ) -> subprocess.Popen | None:
        """The spare's process, now serving this load; None when the spare is gone (start afresh)."""
        try:
            if spare.process.poll() is not None:
                raise OSError(f"it exited with {spare.process.returncode}")
            send_load(spare.control, serve_argv, listener.fileno(), log.fileno())
        except OSError as exc:
            logger.warning(
                "spare replica process %d on %s could not take the load (%s); starting a new process",
                spare.process.pid,
                spare.device,
                exc,
            )
            self._retire(spare)
            return None
        finally:
            spare.control.close()
        return spare.process

    def _spare_devices(self) -> list[str]:
        return [f"cuda:{i}" for i in range(self.gpu_count)] if self.gpu_count else ["cpu"]

    def _tend_spares(self, closing: bool) -> None:
        """Reap stopped spares, replace dead ones, start missing ones where no load is in progress."""
        now = time.monotonic()
        for spare in list(self._spares_retired):
            if spare.process.poll() is not None:
                self._spares_retired.remove(spare)
            elif spare.stop_deadline is not None and now >= spare.stop_deadline:
                self._signal_group(spare.process, signal.SIGKILL)
                spare.stop_deadline = None
        if closing or self.refuse_loads or not self.spare_replicas:
            self._retire_spares()
            return
        # Every GPU of a loading replica split over several: a spare starting on one while its rank
        # sizes the KV cache from the memory free there would take memory the rank counted on.
        loading = {
            device for r in self._replicas.values() if r.state == "loading" for device in load_devices(r.request)
        }
        for device in self._spare_devices():
            spare = self._spares.get(device)
            if spare is not None and spare.process.poll() is not None:
                logger.warning(
                    "spare replica process %d on %s exited with %s; see %s",
                    spare.process.pid,
                    device,
                    spare.process.returncode,
                    self._spare_log(device),
                )
                spare.control.close()
                del self._spares[device]
                self._spare_retry_at[device] = spare.started_at + SPARE_RETRY_S
            if device not in self._spares and device not in loading and now >= self._spare_retry_at.get(device, 0.0):
                self._start_spare(device)

    def _spare_log(self, device: str) -> Path:
        return self.log_dir / f"spare-{device.replace(':', '-')}.log"

    def _start_spare(self, device: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [
            sys.executable,
            "-m",
            "gpuworker",
            "spare",
            "--device",
            device,
            "--control-fd",
            str(theirs.fileno()),
            "--exit-with-parent",
            str(os.getpid()),
        ]
        try:
            with open(self._spare_log(device), "ab") as log:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._child_env(),
                    start_new_session=True,
                    pass_fds=(theirs.fileno(),),
                )
        except OSError as exc:
            ours.close()
            self._spare_retry_at[device] = time.monotonic() + SPARE_RETRY_S
            logger.error("could not start a spare replica process on %s: %s", device, exc)
            return
        finally:
            theirs.close()
        self._spares[device] = Spare(device, process, ours, time.monotonic())
        logger.info("spare replica process %d started on %s", process.pid, device)

    def _retire_spares(self) -> None:
        for device in list(self._spares):
            spare = self._spares.pop(device)
            spare.control.close()
            self._retire(spare)

    def _retire(self, spare: Spare) -> None:
        """SIGTERM the spare (it serves nothing: no drain), SIGKILL it if it lingers."""
        if spare.process.poll() is None:
            self._signal_group(spare.process, signal.SIGTERM)
            spare.stop_deadline = time.monotonic() + KILL_AFTER_S
            self._spares_retired.append(spare)

    def _do_unload(self, replica_id: int, drain_timeout_s: float) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None and replica.pending_load is not None:
            replica.pending_load = None  # unloaded before its failed process let it start
            logger.info("replica %d: the load waiting for its failed process is dropped", replica_id)
            return
        if replica is None or replica.state not in ("loading", "ready"):
            logger.info(
                "unload of replica %d: nothing to do (%s)", replica_id, "unknown" if replica is None else replica.state
            )
            return
        replica.state = "draining"
        replica.drain_deadline = time.monotonic() + drain_timeout_s + DRAIN_GRACE_S
        try:
            self._http.post(f"{replica.endpoint_url}/drain", json={"timeout_s": drain_timeout_s})
        except httpx.HTTPError:
            self._terminate(replica)  # not listening yet (still starting): nothing in flight to wait for
        logger.info("replica %d: draining (timeout %.1fs)", replica_id, drain_timeout_s)

    def _do_unload_all(self, drain_timeout_s: float) -> None:
        for replica_id in list(self._replicas):
            self._do_unload(replica_id, drain_timeout_s)

    def _poll(self) -> None:
        now = time.monotonic()
        for replica_id, replica in list(self._replicas.items()):
            process = replica.process
            if process is not None and process.poll() is not None:
                self._reap(replica)
            elif process is not None:
                if replica.kill_deadline is not None and now >= replica.kill_deadline:
                    logger.warning("replica %d did not stop after SIGTERM; killing it", replica_id)
                    self._signal(replica, signal.SIGKILL)
                    replica.kill_deadline = None
                elif replica.state in ("loading", "ready"):
                    self._check_health(replica)
                elif replica.state == "draining" and replica.kill_deadline is None:
                    stats = self._get(replica, "/stats")
                    replica.figures = stats or replica.figures
                    # No answer is no reason to wait: on SIGTERM the child drains by itself.
                    if stats is None or stats.get("in_flight", 0) == 0 or now >= replica.drain_deadline:
                        self._terminate(replica)
            elif replica.ended_at is not None and now - replica.ended_at > FORGET_AFTER_S:
                del self._replicas[replica_id]

    def _check_health(self, replica: Replica) -> None:
        health = self._get(replica, "/health")
        if health is None:
            return  # not listening yet
        status = health.get("status")
        if status == "ready":
            replica.state, replica.load_progress = "ready", 1.0
            replica.figures = self._get(replica, "/stats") or replica.figures
        elif status == "loading":
            replica.load_progress = float(health.get("progress", 0.0))
        elif status == "failed":
            # The replica caught its own error: that is the cause; its log adds where it came from.
            self._end(
                replica,
                "failed",
                failure_message(
                    cause=str(health.get("error") or ""),
                    what="the replica failed to load",
                    log_text=self._log_text(replica),
                ),
            )
            logger.error("replica %d failed: %s", replica.request.replica_id, replica.error)
            self._terminate(replica)

    def _get(self, replica: Replica, path: str) -> dict[str, Any] | None:
        try:
            return self._http.get(f"{replica.endpoint_url}{path}").json()
        except (httpx.HTTPError, ValueError):
            return None

    def _reap(self, replica: Replica) -> None:
        code = replica.process.returncode
        replica.ended_pid = replica.process.pid
        replica.process, replica.kill_deadline = None, None
        if replica.state == "draining":
            self._end(replica, "stopped", "")
            logger.info("replica %d stopped", replica.request.replica_id)
        elif replica.state == "loading" and replica.from_spare and not self._log_text(replica).strip():
            # A spare writes to the replica's log as soon as it takes a load: this one died before
            # (it was killed as the load was handed over), so the load never began: start it afresh.
            logger.warning(
                "replica %d: spare pid %d died (%s) before taking the load; starting a new process",
                replica.request.replica_id,
                replica.ended_pid,
                code,
            )
            del self._replicas[replica.request.replica_id]
            self._do_load(replica.request)
            return
        elif replica.state in ("loading", "ready"):
            log_text = self._log_text(replica)
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
            # SIGKILL comes from outside (the OOM killer, an operator) and is the whole cause: an
            # error in the log is then something the replica lived through. Other deaths (a
            # status, SIGABRT from a C++ terminate) follow the error the process logged.
            cause = "" if code == -signal.SIGKILL else error_cause(log_text)
            what = f"the replica process {how}"
            self._end(replica, "failed", failure_message(cause=cause, what=what, log_text=log_text))
            logger.error("replica %d: %s", replica.request.replica_id, replica.error)
        if replica.pending_load is not None:
            self._do_load(replica.pending_load)

    def _log_text(self, replica: Replica) -> str:
        """The end of what this replica's process wrote (not an earlier load's part of the log)."""
        try:
            with open(replica.log_path, "rb") as log:
                log.seek(max(replica.log_start, os.fstat(log.fileno()).st_size - LOG_READ_CHARS))
                return log.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def _terminate(self, replica: Replica) -> None:
        """SIGTERM: the child drains what is in flight itself, so it may take until the drain deadline."""
        self._signal(replica, signal.SIGTERM)
        replica.kill_deadline = max(time.monotonic(), replica.drain_deadline or 0.0) + KILL_AFTER_S

    def _signal(self, replica: Replica, signum: int) -> None:
        self._signal_group(replica.process, signum)

    @staticmethod
    def _signal_group(process: subprocess.Popen, signum: int) -> None:
        try:
            os.killpg(process.pid, signum)  # its own group: whatever it forked goes too
        except ProcessLookupError:
            pass

    def _end(self, replica: Replica, state: str, error: str) -> None:
        replica.state, replica.error, replica.ended_at = state, error, time.monotonic()
        replica.figures = {}


def _device(request: LoadModel) -> str:
    return "cpu" if request.gpu_index is None else f"cuda:{request.gpu_index}"


def load_devices(request: LoadModel) -> list[str]:
    """Every device a load runs on: its tensor_parallel_size GPUs from gpu_index (rank r on
    gpu_index + r, as gpuworker.engine.parallel.rank_device), or the CPU."""
    if request.gpu_index is None:
        return ["cpu"]
    return [f"cuda:{request.gpu_index + rank}" for rank in range(request.tensor_parallel_size)]


def reported_prefix_keys(value: Any) -> tuple[str, ...]:
    """A replica's /stats prefix_keys as the heartbeat carries them: digests only, bounded (a
    replica that sends anything else cannot make the worker's heartbeat invalid)."""
    if not isinstance(value, list):
        return ()
    return tuple(key for key in value if is_prefix_key_digest(key))[:MAX_REPORTED_PREFIX_KEYS]


def image_limit_arguments(request: LoadModel) -> list[str]:
    """The serve flags carrying the load's image limits (those it sets; the others keep the
    replica's defaults)."""
    flags = {
        "--max-images-per-request": request.max_images_per_request,
        "--max-image-bytes": request.max_image_bytes,
        "--max-image-pixels": request.max_image_pixels,
        "--low-detail-pixels": request.low_detail_pixels,
    }
    return [item for flag, value in flags.items() if value is not None for item in (flag, str(value))]
