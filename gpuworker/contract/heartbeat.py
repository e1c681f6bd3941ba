"""What a worker daemon sends the control plane: its registration and a heartbeat about every second
(JSON over HTTP). The daemon builds these dataclasses and sends `to_json()`; the control plane reads
them back with `parse_registration` / `parse_heartbeat`, where a bad field raises ContractError
naming it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gpuworker.contract.prefix_keys import MAX_REPORTED_PREFIX_KEYS, is_prefix_key_digest


class ContractError(ValueError):
    """A message that breaks the contract; `field` says where (e.g. "replicas[0].state")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


REPLICA_STATES = ("loading", "ready", "draining", "stopped", "failed")
# Figures only shown and used for routing; a missing or null one is left out.
GPU_FIGURES = ("utilization_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w")
CPU_FIGURES = ("utilization_pct", "memory_used_bytes", "memory_total_bytes")
# Latency figures are p95 seconds over the replica's last minute (or its last 10,000 samples),
# absent while it has none: time to first token, and time between a request's consecutive tokens.
REPLICA_LATENCY_FIGURES = ("ttft_p95_s", "itl_p95_s")
REPLICA_FIGURES = (
    "load_progress",
    "running",
    "waiting",
    "kv_cache_usage",
    "tokens_per_s",
    "prefix_cache_hit_rate",
    # Prompt tokens served from the host KV tier, as a share of the prompt tokens looked up.
    "host_cache_hit_rate",
    # The load the gateway sheds by: prompt tokens not yet prefilled (waiting requests' and those
    # mid-prefill) and prompt tokens prefilled per second lately (their quotient: the queue's wait).
    "waiting_tokens",
    "prefill_tokens_per_s",
    *REPLICA_LATENCY_FIGURES,
)
# A replica's error is kept to this many characters (its cause comes first: see the daemon's
# gpuworker/daemon/replica_errors.py).
MAX_REPLICA_ERROR_CHARS = 4000
# A replica reports the shares of the GPU its busiest tenants took lately, at most this many.
MAX_TENANT_SHARES = 16
MAX_MODEL_ROOTS = 32
MAX_MODEL_PATHS = 2000
MAX_STAGED = 64
STAGING_HOWS = ("page_cache", "pinned")
# How a found checkpoint's weights are stored (gpuworker.checkpoint_quantization's QuantConfig.label);
# a float checkpoint is left out of the report.
QUANTIZATION_LABELS = ("fp8", "int8", "awq-int4", "gptq-int4")


@dataclass(frozen=True)
class GpuSpec:
    index: int
    name: str
    memory_total_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "memory_total_bytes": self.memory_total_bytes}


# What a found checkpoint serves as (gpuworker.architectures' kinds; "" while it serves none).
CHECKPOINT_KINDS = ("chat", "vision", "embedding", "")
MAX_CHECKPOINT_PROBLEM_CHARS = 1000


@dataclass(frozen=True)
class CheckpointReport:
    """What a daemon read from one found checkpoint's config.json and weight headers, so the
    catalog can be filled without asking the operator: the Hugging Face id it answers to under the
    model roots ("org/name" for root/org/name or the HF cache's current snapshot; "" for none), its
    architecture and family, what it serves as, its size and context, or why it cannot be served."""

    repo_id: str = ""
    architecture: str = ""
    family: str = ""  # config.json's model_type, e.g. "llama"
    kind: str = ""  # CHECKPOINT_KINDS
    parameter_count: int | None = None
    context_length: int | None = None
    problem: str = ""  # non-empty: the engine cannot serve it, and why

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "architecture": self.architecture,
            "family": self.family,
            "kind": self.kind,
            "parameter_count": self.parameter_count,
            "context_length": self.context_length,
            "problem": self.problem,
        }


@dataclass(frozen=True)
class ModelPaths:
    """The directories a daemon searches for checkpoints and the checkpoint directories it found."""

    roots: tuple[str, ...]
    paths: tuple[str, ...]
    # (path, QUANTIZATION_LABELS entry) for each quantized checkpoint among paths.
    quantization: tuple[tuple[str, str], ...] = ()
    # (path, what was read there) for the checkpoints among paths that were read.
    checkpoints: tuple[tuple[str, CheckpointReport], ...] = ()

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"roots": list(self.roots), "paths": list(self.paths)}
        if self.quantization:
            body["quantization"] = dict(self.quantization)
        if self.checkpoints:
            body["checkpoints"] = {path: report.to_json() for path, report in self.checkpoints}
        return body


@dataclass(frozen=True)
class WorkerRegistration:
    name: str
    advertise_host: str
    device: str
    gpus: tuple[GpuSpec, ...]
    cpu_memory_total_bytes: int
    cpu_cores: int
    version: str = ""
    # None: a daemon that does not report model paths (started without --model-root).
    models: ModelPaths | None = None

    def to_json(self) -> dict[str, Any]:
        body = {
            "name": self.name,
            "advertise_host": self.advertise_host,
            "device": self.device,
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "cpu": {"memory_total_bytes": self.cpu_memory_total_bytes, "cores": self.cpu_cores},
            "version": self.version,
        }
        if self.models is not None:
            body["models"] = self.models.to_json()
        return body


@dataclass(frozen=True)
class ReplicaReport:
    replica_id: int
    state: str
    endpoint_url: str = ""
    error: str = ""
    # REPLICA_FIGURES: load_progress, running, waiting, kv_cache_usage...
    figures: dict[str, float] = field(default_factory=dict)
    # The process serving it on the worker's host, while there is one (None: none, or a daemon that
    # does not report it); operators and the chaos suite find the replica's process by it.
    pid: int | None = None
    # Digests (contract.prefix_keys) of the conversations whose prompt blocks its KV tiers hold.
    prefix_keys: tuple[str, ...] = ()
    # Tenant id ("" for requests without one) -> its share (0-1) of the weighted tokens the engine
    # served lately, the busiest MAX_TENANT_SHARES tenants.
    tenant_shares: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        body = {
            "replica_id": self.replica_id,
            "state": self.state,
            "endpoint_url": self.endpoint_url,
            "error": self.error,
            **self.figures,
        }
        if self.pid is not None:
            body["pid"] = self.pid
        if self.prefix_keys:
            body["prefix_keys"] = list(self.prefix_keys)
        if self.tenant_shares:
            body["tenant_shares"] = dict(self.tenant_shares)
        return body


@dataclass(frozen=True)
class StagedWeights:
    """A checkpoint a worker keeps warm for fast loads: its weight bytes, how, and the share of
    those bytes in host memory right now (the page cache can drop pages under pressure)."""

    path: str
    bytes: int
    how: str  # STAGING_HOWS
    resident_fraction: float

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "how": self.how, "resident_fraction": self.resident_fraction}


@dataclass(frozen=True)
class Staging:
    """The worker's staging budget (--stage-budget-bytes; 0: off) and what it holds now."""

    budget_bytes: int
    models: tuple[StagedWeights, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "models": [m.to_json() for m in self.models]}


@dataclass(frozen=True)
class Heartbeat:
    sent_at: str
    draining: bool
    gpus: tuple[dict[str, float], ...]  # {"index": i, GPU_FIGURES...}
    cpu: dict[str, float]  # CPU_FIGURES
    replicas: tuple[ReplicaReport, ...]
    # Sent only when the daemon's scan changed since the control plane last took it.
    models: ModelPaths | None = None
    # None: a daemon from before staging existed.
    staging: Staging | None = None

    def to_json(self) -> dict[str, Any]:
        body = {
            "sent_at": self.sent_at,
            "draining": self.draining,
            "gpus": list(self.gpus),
            "cpu": self.cpu,
            "replicas": [replica.to_json() for replica in self.replicas],
        }
        if self.models is not None:
            body["models"] = self.models.to_json()
        if self.staging is not None:
            body["staging"] = self.staging.to_json()
        return body


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ContractError(where, "Must be a JSON object.")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ContractError(where, "Must be a JSON array.")
    return value


def _int(value: Any, where: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ContractError(where, f"Must be an integer of at least {minimum}.")
    return value


def _text(value: Any, where: str, *, max_length: int, required: bool = True) -> str:
    if not isinstance(value, str) or (required and not value.strip()) or len(value) > max_length:
        need = "a non-empty string" if required else "a string"
        raise ContractError(where, f"Must be {need} of at most {max_length} characters.")
    return value


def _figures(raw: dict, names: tuple[str, ...], where: str) -> dict[str, float]:
    """The known numeric figures present in `raw` (missing or null ones are left out)."""
    figures = {}
    for name in names:
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ContractError(f"{where}.{name}", "Must be a number.")
        figures[name] = value
    return figures


def _paths(value: Any, where: str, *, limit: int) -> tuple[str, ...]:
    items = _list(value, where)
    if len(items) > limit:
        raise ContractError(where, f"At most {limit} entries.")
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item.startswith("/") or len(item) > 500:
            raise ContractError(f"{where}[{i}]", "Must be an absolute path of at most 500 characters.")
    return tuple(items)


def _model_paths(value: Any) -> ModelPaths | None:
    if value is None:
        return None
    raw = _object(value, "models")
    paths = _paths(raw.get("paths", []), "models.paths", limit=MAX_MODEL_PATHS)
    quantization = _object(raw.get("quantization", {}), "models.quantization")
    for path, label in quantization.items():
        if path not in paths:
            raise ContractError(f"models.quantization[{path!r}]", "Must be one of models.paths.")
        if label not in QUANTIZATION_LABELS:
            raise ContractError(f"models.quantization[{path!r}]", f"Must be one of {', '.join(QUANTIZATION_LABELS)}.")
    checkpoints = _object(raw.get("checkpoints", {}), "models.checkpoints")
    for path in checkpoints:
        if path not in paths:
            raise ContractError(f"models.checkpoints[{path!r}]", "Must be one of models.paths.")
    return ModelPaths(
        roots=_paths(raw.get("roots", []), "models.roots", limit=MAX_MODEL_ROOTS),
        paths=paths,
        quantization=tuple(sorted(quantization.items())),
        checkpoints=tuple(
            (path, _checkpoint_report(report, f"models.checkpoints[{path!r}]"))
            for path, report in sorted(checkpoints.items())
        ),
    )


def _optional_count(value: Any, where: str) -> int | None:
    return None if value is None else _int(value, where, minimum=1)


def _checkpoint_report(value: Any, where: str) -> CheckpointReport:
    raw = _object(value, where)
    kind = raw.get("kind", "")
    if kind not in CHECKPOINT_KINDS:
        raise ContractError(f"{where}.kind", f"Must be one of {', '.join(map(repr, CHECKPOINT_KINDS))}.")
    return CheckpointReport(
        repo_id=_text(raw.get("repo_id", ""), f"{where}.repo_id", max_length=200, required=False),
        architecture=_text(raw.get("architecture", ""), f"{where}.architecture", max_length=100, required=False),
        family=_text(raw.get("family", ""), f"{where}.family", max_length=50, required=False),
        kind=kind,
        parameter_count=_optional_count(raw.get("parameter_count"), f"{where}.parameter_count"),
        context_length=_optional_count(raw.get("context_length"), f"{where}.context_length"),
        problem=_text(
            raw.get("problem", ""), f"{where}.problem", max_length=MAX_CHECKPOINT_PROBLEM_CHARS, required=False
        ),
    )


def _staging(value: Any) -> Staging | None:
    if value is None:
        return None
    raw = _object(value, "staging")
    items = _list(raw.get("models", []), "staging.models")
    if len(items) > MAX_STAGED:
        raise ContractError("staging.models", f"At most {MAX_STAGED} entries.")
    models = []
    for i, item in enumerate(items):
        item, where = _object(item, f"staging.models[{i}]"), f"staging.models[{i}]"
        path = item.get("path")
        if not isinstance(path, str) or not path.startswith("/") or len(path) > 500:
            raise ContractError(f"{where}.path", "Must be an absolute path of at most 500 characters.")
        how = item.get("how")
        if how not in STAGING_HOWS:
            raise ContractError(f"{where}.how", f"Must be one of {', '.join(STAGING_HOWS)}.")
        fraction = item.get("resident_fraction")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ContractError(f"{where}.resident_fraction", "Must be a number from 0 to 1.")
        models.append(
            StagedWeights(
                path=path, bytes=_int(item.get("bytes"), f"{where}.bytes"), how=how, resident_fraction=float(fraction)
            )
        )
    return Staging(budget_bytes=_int(raw.get("budget_bytes", 0), "staging.budget_bytes"), models=tuple(models))


def parse_registration(data: Any) -> WorkerRegistration:
    data = _object(data, "body")
    device = data.get("device")
    if device not in ("cuda", "cpu"):
        raise ContractError("device", "Must be 'cuda' or 'cpu'.")
    gpus = []
    for i, raw in enumerate(_list(data.get("gpus", []), "gpus")):
        raw = _object(raw, f"gpus[{i}]")
        gpus.append(
            GpuSpec(
                index=_int(raw.get("index"), f"gpus[{i}].index"),
                name=_text(raw.get("name"), f"gpus[{i}].name", max_length=100),
                memory_total_bytes=_int(raw.get("memory_total_bytes"), f"gpus[{i}].memory_total_bytes", minimum=1),
            )
        )
    if len({gpu.index for gpu in gpus}) != len(gpus):
        raise ContractError("gpus", "Each GPU index may appear once.")
    if device == "cuda" and not gpus:
        raise ContractError("gpus", "A cuda worker must report at least one GPU.")
    cpu = _object(data.get("cpu", {}), "cpu")
    return WorkerRegistration(
        name=_text(data.get("name"), "name", max_length=80),
        advertise_host=_text(data.get("advertise_host"), "advertise_host", max_length=255),
        device=device,
        gpus=tuple(gpus),
        cpu_memory_total_bytes=_int(cpu.get("memory_total_bytes", 0), "cpu.memory_total_bytes"),
        cpu_cores=_int(cpu.get("cores", 0), "cpu.cores"),
        version=_text(data.get("version", ""), "version", max_length=50, required=False),
        models=_model_paths(data.get("models")),
    )


def parse_heartbeat(data: Any) -> Heartbeat:
    data = _object(data, "body")
    draining = data.get("draining", False)
    if not isinstance(draining, bool):
        raise ContractError("draining", "Must be true or false.")
    gpus = []
    for i, raw in enumerate(_list(data.get("gpus", []), "gpus")):
        raw = _object(raw, f"gpus[{i}]")
        gpus.append({"index": _int(raw.get("index"), f"gpus[{i}].index"), **_figures(raw, GPU_FIGURES, f"gpus[{i}]")})
    cpu = _figures(_object(data.get("cpu", {}), "cpu"), CPU_FIGURES, "cpu")
    replicas = []
    for i, raw in enumerate(_list(data.get("replicas", []), "replicas")):
        replicas.append(_replica_report(_object(raw, f"replicas[{i}]"), f"replicas[{i}]"))
    if len({r.replica_id for r in replicas}) != len(replicas):
        raise ContractError("replicas", "Each replica_id may appear once.")
    return Heartbeat(
        sent_at=_text(data.get("sent_at", ""), "sent_at", max_length=64, required=False),
        draining=draining,
        gpus=tuple(gpus),
        cpu=cpu,
        replicas=tuple(replicas),
        models=_model_paths(data.get("models")),
        staging=_staging(data.get("staging")),
    )


def _replica_report(raw: dict, where: str) -> ReplicaReport:
    state = raw.get("state")
    if state not in REPLICA_STATES:
        raise ContractError(f"{where}.state", f"Must be one of {', '.join(REPLICA_STATES)}.")
    endpoint_url = _text(raw.get("endpoint_url") or "", f"{where}.endpoint_url", max_length=300, required=False)
    if endpoint_url:
        parts = urlsplit(endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ContractError(f"{where}.endpoint_url", "Must be an http:// or https:// URL with a host.")
    elif state == "ready":
        raise ContractError(f"{where}.endpoint_url", "A ready replica must report its endpoint URL.")
    return ReplicaReport(
        replica_id=_int(raw.get("replica_id"), f"{where}.replica_id", minimum=1),
        state=state,
        endpoint_url=endpoint_url,
        # Errors come from tracebacks and child output: keep the useful start, bounded.
        error=_text(raw.get("error") or "", f"{where}.error", max_length=100_000, required=False)[
            :MAX_REPLICA_ERROR_CHARS
        ],
        figures=_figures(raw, REPLICA_FIGURES, where),
        pid=None if raw.get("pid") is None else _int(raw["pid"], f"{where}.pid", minimum=1),
        prefix_keys=_prefix_keys(raw.get("prefix_keys", []), f"{where}.prefix_keys"),
        tenant_shares=_tenant_shares(raw.get("tenant_shares") or {}, f"{where}.tenant_shares"),
    )


def _prefix_keys(value: Any, where: str) -> tuple[str, ...]:
    items = _list(value, where)
    if len(items) > MAX_REPORTED_PREFIX_KEYS:
        raise ContractError(where, f"At most {MAX_REPORTED_PREFIX_KEYS} entries.")
    for i, item in enumerate(items):
        if not is_prefix_key_digest(item):
            raise ContractError(f"{where}[{i}]", "Must be a prefix key digest (16 lowercase hex digits).")
    return tuple(items)


def _tenant_shares(value: Any, where: str) -> dict[str, float]:
    if not isinstance(value, dict) or len(value) > MAX_TENANT_SHARES:
        raise ContractError(where, f"Must be an object of at most {MAX_TENANT_SHARES} tenants.")
    for tenant, share in value.items():
        _text(tenant, f"{where} key", max_length=40, required=False)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ContractError(f"{where}.{tenant}", "Must be a share between 0 and 1.")
    return {tenant: float(share) for tenant, share in value.items()}
