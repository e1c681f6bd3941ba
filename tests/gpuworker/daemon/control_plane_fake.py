"""A loopback stand-in for the control plane's /internal/workers HTTP API (issue #5's contract), for
the daemon's tests: it checks the token and every payload's shape strictly, records what arrives,
and can answer a heartbeat with 404 or with replicas to unload.

    with ControlPlaneFake(token="t", broker_url="redis://127.0.0.1:6379/11") as fake:
        ... start a daemon with --control-url fake.url ...
        fake.wait_for(lambda: fake.replica(7, "ready"))
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

REGISTER_KEYS = {"name", "advertise_host", "device", "gpus", "cpu", "version"}
HEARTBEAT_KEYS = {"sent_at", "draining", "gpus", "cpu", "replicas"}
GPU_INVENTORY_KEYS = {"index", "name", "memory_total_bytes"}
GPU_FIGURE_KEYS = {"index", "utilization_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w"}
CPU_INVENTORY_KEYS = {"memory_total_bytes", "cores"}
CPU_FIGURE_KEYS = {"utilization_pct", "memory_used_bytes", "memory_total_bytes"}
REPLICA_KEYS = {
    "replica_id",
    "state",
    "endpoint_url",
    "load_progress",
    "error",
    "running",
    "waiting",
    "kv_cache_usage",
    "tokens_per_s",
    "prefix_cache_hit_rate",
    "host_cache_hit_rate",
    "waiting_tokens",
    "prefill_tokens_per_s",
}
# The digests of the conversations whose KV the replica holds: present only when there are some.
REPLICA_PREFIX_KEYS_KEY = "prefix_keys"
# Latency p95s in seconds: present once the replica has a sample, absent (never 0 or null) before.
REPLICA_LATENCY_KEYS = {"ttft_p95_s", "itl_p95_s"}
# The pid of the process serving the replica: present once there is one, absent (never 0 or null) before.
REPLICA_PID_KEY = "pid"
# Tenant id -> share (0-1) of the replica's recent service: present once it served someone.
REPLICA_SHARES_KEY = "tenant_shares"
REPLICA_STATES = {"loading", "ready", "draining", "stopped", "failed"}
# Sent by a daemon with --model-root: at registration, and in a heartbeat when the scan changed;
# `quantization` (path -> how its weights are stored) only when a found checkpoint is quantized;
# `checkpoints` (path -> what was read there) when any checkpoint was found.
MODELS_KEYS = {"roots", "paths"}
MODELS_OPTIONAL_KEYS = {"quantization", "checkpoints"}
CHECKPOINT_KEYS = {"repo_id", "architecture", "family", "kind", "parameter_count", "context_length", "problem"}


class ShapeError(ValueError):
    pass


def _keys(where: str, value: Any, keys: set[str]) -> None:
    if not isinstance(value, dict) or set(value) != keys:
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise ShapeError(f"{where}: expected keys {sorted(keys)}, got {got}")


def _models(where: str, body: dict, keys: set[str]) -> None:
    """The optional `models` report, then the other keys exactly."""
    if not isinstance(body, dict):
        _keys(where, body, keys)  # raises, naming what came instead
    if "models" in body:
        models = body["models"]
        _keys(
            f"{where}.models",
            {k: v for k, v in models.items() if k not in MODELS_OPTIONAL_KEYS} if isinstance(models, dict) else models,
            MODELS_KEYS,
        )
        quantization = models.get("quantization", {})
        if not isinstance(quantization, dict) or not all(
            isinstance(p, str) and p.startswith("/") and isinstance(q, str) and q for p, q in quantization.items()
        ):
            raise ShapeError(f"{where}.models.quantization: expected absolute path -> label, got {quantization!r}")
        checkpoints = models.get("checkpoints", {})
        if not isinstance(checkpoints, dict) or not all(isinstance(p, str) and p.startswith("/") for p in checkpoints):
            raise ShapeError(f"{where}.models.checkpoints: expected absolute path -> report, got {checkpoints!r}")
        for path, report in checkpoints.items():
            _keys(f"{where}.models.checkpoints[{path!r}]", report, CHECKPOINT_KEYS)
        for key in sorted(MODELS_KEYS):
            if not isinstance(body["models"][key], list) or not all(
                isinstance(p, str) and p.startswith("/") for p in body["models"][key]
            ):
                raise ShapeError(
                    f"{where}.models.{key}: expected a list of absolute paths, got {body['models'][key]!r}"
                )
    _keys(where, {k: v for k, v in body.items() if k != "models"}, keys)


def _number(where: str, value: Any, low: float = 0.0, high: float = float("inf"), integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        raise ShapeError(
            f"{where}: expected a{'n integer' if integer else ' number'} in [{low}, {high}], got {value!r}"
        )


def check_register(body: Any) -> None:
    _models("register", body, REGISTER_KEYS)
    for key in ("name", "advertise_host", "version"):
        if not isinstance(body[key], str) or not body[key]:
            raise ShapeError(f"register.{key}: expected a non-empty string, got {body[key]!r}")
    if body["device"] not in ("cuda", "cpu"):
        raise ShapeError(f"register.device: expected cuda or cpu, got {body['device']!r}")
    if not isinstance(body["gpus"], list) or (body["device"] == "cpu") != (body["gpus"] == []):
        raise ShapeError(f"register.gpus: expected a list, empty exactly when device is cpu, got {body['gpus']!r}")
    for i, gpu in enumerate(body["gpus"]):
        _keys(f"register.gpus[{i}]", gpu, GPU_INVENTORY_KEYS)
        _number(f"register.gpus[{i}].index", gpu["index"], integer=True)
        _number(f"register.gpus[{i}].memory_total_bytes", gpu["memory_total_bytes"], 1, integer=True)
    _keys("register.cpu", body["cpu"], CPU_INVENTORY_KEYS)
    _number("register.cpu.memory_total_bytes", body["cpu"]["memory_total_bytes"], 1, integer=True)
    _number("register.cpu.cores", body["cpu"]["cores"], 1, integer=True)


def check_heartbeat(body: Any) -> None:
    if isinstance(body, dict) and "staging" in body:  # what the worker keeps warm (StageWeights)
        body = dict(body)
        _keys("heartbeat.staging", body.pop("staging"), {"budget_bytes", "models"})
    _models("heartbeat", body, HEARTBEAT_KEYS)
    if not isinstance(body["sent_at"], str) or datetime.fromisoformat(body["sent_at"]).tzinfo is None:
        raise ShapeError(f"heartbeat.sent_at: expected an ISO-8601 time with a zone, got {body['sent_at']!r}")
    if not isinstance(body["draining"], bool):
        raise ShapeError(f"heartbeat.draining: expected a bool, got {body['draining']!r}")
    for i, gpu in enumerate(body["gpus"]):
        _keys(f"heartbeat.gpus[{i}]", gpu, GPU_FIGURE_KEYS)
    _keys("heartbeat.cpu", body["cpu"], CPU_FIGURE_KEYS)
    _number("heartbeat.cpu.utilization_pct", body["cpu"]["utilization_pct"], 0, 100)
    _number("heartbeat.cpu.memory_total_bytes", body["cpu"]["memory_total_bytes"], 1, integer=True)
    _number(
        "heartbeat.cpu.memory_used_bytes",
        body["cpu"]["memory_used_bytes"],
        0,
        body["cpu"]["memory_total_bytes"],
        integer=True,
    )
    if not isinstance(body["replicas"], list):
        raise ShapeError("heartbeat.replicas: expected a list")
    for i, replica in enumerate(body["replicas"]):
        where = f"heartbeat.replicas[{i}]"
        optional = REPLICA_LATENCY_KEYS | {REPLICA_PID_KEY, REPLICA_PREFIX_KEYS_KEY, REPLICA_SHARES_KEY}
        _keys(where, {k: v for k, v in replica.items() if k not in optional}, REPLICA_KEYS)
        if REPLICA_PID_KEY in replica:
            _number(f"{where}.{REPLICA_PID_KEY}", replica[REPLICA_PID_KEY], 1, integer=True)
        for tenant, share in replica.get(REPLICA_SHARES_KEY, {}).items():
            if not isinstance(tenant, str):
                raise ShapeError(f"{where}.{REPLICA_SHARES_KEY}: tenants must be strings, got {tenant!r}")
            _number(f"{where}.{REPLICA_SHARES_KEY}.{tenant}", share, 0, 1)
        for key in REPLICA_LATENCY_KEYS & set(replica):
            _number(f"{where}.{key}", replica[key])
            if replica[key] <= 0:
                raise ShapeError(f"{where}.{key}: a latency must be > 0 s, got {replica[key]!r}")
        _number(f"{where}.replica_id", replica["replica_id"], integer=True)
        if replica["state"] not in REPLICA_STATES:
            raise ShapeError(f"{where}.state: expected one of {sorted(REPLICA_STATES)}, got {replica['state']!r}")
        if not isinstance(replica["endpoint_url"], str) or not isinstance(replica["error"], str):
            raise ShapeError(f"{where}: endpoint_url and error must be strings")
        _number(f"{where}.load_progress", replica["load_progress"], 0, 1)
        for key in ("running", "waiting", "waiting_tokens"):
            _number(f"{where}.{key}", replica[key], integer=True)
        prefix_keys = replica.get(REPLICA_PREFIX_KEYS_KEY, ["0" * 16])
        if not prefix_keys or not all(isinstance(k, str) and len(k) == 16 for k in prefix_keys):
            raise ShapeError(f"{where}.prefix_keys: a non-empty list of 16-character digests when sent")
        for key in ("kv_cache_usage", "prefix_cache_hit_rate", "host_cache_hit_rate"):
            _number(f"{where}.{key}", replica[key], 0, 1)
        _number(f"{where}.tokens_per_s", replica["tokens_per_s"])
        _number(f"{where}.prefill_tokens_per_s", replica["prefill_tokens_per_s"])


class ControlPlaneFake:
    def __init__(self, *, token: str, broker_url: str, heartbeat_interval_s: float = 0.3) -> None:
        self.token, self.broker_url, self.heartbeat_interval_s = token, broker_url, heartbeat_interval_s
        self.lock = threading.Lock()
        self.registrations: list[dict] = []
        self.heartbeats: list[tuple[int, dict]] = []
        self.errors: list[str] = []  # shape or token problems; a test asserts none
        self.workers: dict[str, int] = {}
        self.answer_404 = 0  # answer this many coming heartbeats with 404
        self.refuse_registrations = 0  # answer this many coming registrations with 503
        self.unload: set[int] = set()  # replica ids named in heartbeat answers
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                fake._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ControlPlaneFake:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def queue_of(self, name: str) -> str:
        return f"gpuworker.{name}"

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        def answer(status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            request.send_response(status)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(data)))
            request.end_headers()
            request.wfile.write(data)

        if request.headers.get("Authorization") != f"Bearer {self.token}":
            with self.lock:
                self.errors.append(f"{request.path}: bad Authorization header")
            return answer(401, {"error": "missing or wrong worker token"})
        try:
            body = json.loads(request.rfile.read(int(request.headers.get("Content-Length", 0))))
            parts = request.path.strip("/").split("/")
            if request.path == "/internal/workers/register":
                check_register(body)
                with self.lock:
                    if self.refuse_registrations > 0:
                        self.refuse_registrations -= 1
                        return answer(503, {"error": "starting up"})
                    self.registrations.append(body)
                    worker_id = self.workers.setdefault(body["name"], len(self.workers) + 1)
                return answer(
                    200,
                    {
                        "worker_id": worker_id,
                        "queue": self.queue_of(body["name"]),
                        "heartbeat_interval_s": self.heartbeat_interval_s,
                        "celery": {"broker_url": self.broker_url, "broker_transport_options": {}},
                    },
                )
            if len(parts) == 4 and parts[:2] == ["internal", "workers"] and parts[3] == "heartbeat":
                check_heartbeat(body)
                with self.lock:
                    if self.answer_404 > 0 or int(parts[2]) not in self.workers.values():
                        self.answer_404 = max(0, self.answer_404 - 1)
                        return answer(404, {"error": f"unknown worker {parts[2]}"})
                    self.heartbeats.append((int(parts[2]), body))
                    unload = sorted(self.unload & {r["replica_id"] for r in body["replicas"]})
                return answer(200, {"ok": True, "unload": unload} if unload else {"ok": True})
            return answer(404, {"error": f"no endpoint {request.path}"})
        except (ShapeError, ValueError, KeyError) as exc:
            with self.lock:
                self.errors.append(f"{request.path}: {exc}")
            return answer(400, {"error": str(exc)})

    # -- for the tests --------------------------------------------------------------------------

    def latest(self) -> dict | None:
        with self.lock:
            return self.heartbeats[-1][1] if self.heartbeats else None

    def replica(self, replica_id: int, *states: str) -> dict | None:
        """The replica's entry in the latest heartbeat, if it is in one of `states` (any if none)."""
        latest = self.latest()
        for entry in (latest or {}).get("replicas", []):
            if entry["replica_id"] == replica_id and (not states or entry["state"] in states):
                return entry
        return None

    def wait_for(self, condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := condition():
                return value
            time.sleep(0.05)
        raise AssertionError(
            f"timed out after {timeout}s waiting for {what}; latest heartbeat: {self.latest()}; errors: {self.errors}"
        )
