"""What the fleet page shows, shaped for its templates: workers with one slot per GPU (plus the
host's CPU), each slot's live figures with a short history for its sparklines, the replicas placed
there, and each deployment with its status. No ORM here: the reads are fleet selectors, and the
names of the tenants a replica serves come from accounts' cached lookup (tenant_names).

The history is kept by whoever renders repeatedly (a WebSocket connection keeps one per open page),
starting from the last minute of figures the fleet keeps per worker (`FigureHistory.recent`), so a
page's sparklines are drawn full from the moment it opens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from controlplane.accounts.selectors import tenant_names
from controlplane.fleet.heartbeat_cache import RECENT_FIGURES
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.selectors import (
    deployment_statuses,
    deployments_with_live_replicas,
    workers_latest_heartbeats,
    workers_recent_figures,
    workers_with_live_replicas,
)

# About a minute of one-second heartbeats.
HISTORY_POINTS = RECENT_FIGURES
# Stored figures older than this are not drawn: after a silence the line starts afresh.
HISTORY_MAX_AGE_S = 2 * HISTORY_POINTS
SPARK_WIDTH, SPARK_HEIGHT = 120, 28
CPU_SLOT = "cpu"


class FigureHistory:
    """The last HISTORY_POINTS values of every figure, keyed (worker id, slot key, figure name)."""

    def __init__(self) -> None:
        self._series: dict[tuple[int, str, str], deque[float]] = {}

    def record(self, live: dict[str, Any]) -> None:
        worker_id = live.get("worker_id")
        if worker_id is None:
            return
        for slot, figures in _slot_figures(live).items():
            for name, value in _values(figures).items():
                if value is not None:
                    self._series.setdefault((worker_id, slot, name), deque(maxlen=HISTORY_POINTS)).append(value)

    @classmethod
    def recent(cls, *, worker_ids: list[int] | None = None, now: float | None = None) -> "FigureHistory":
        """A history holding the figures of the workers' (all, or these) recent heartbeats."""
        history = cls()
        since = (now or time.time()) - HISTORY_MAX_AGE_S
        for worker_id, figures in workers_recent_figures(worker_ids=worker_ids, since=since).items():
            for beat in figures:
                history.record({"worker_id": worker_id, **beat})
        return history

    def series(self, worker_id: int, slot: str, name: str) -> list[float]:
        return list(self._series.get((worker_id, slot, name), ()))


def _slot_figures(live: dict[str, Any]) -> dict[str, dict[str, Any]]:
    slots = {f"gpu{gpu['index']}": gpu for gpu in live.get("gpus") or [] if "index" in gpu}
    if live.get("cpu"):
        slots[CPU_SLOT] = live["cpu"]
    return slots


def _values(figures: dict[str, Any]) -> dict[str, float | None]:
    """The four plotted figures: utilisation %, memory used %, temperature °C, power W."""
    used, total = figures.get("memory_used_bytes"), figures.get("memory_total_bytes")
    return {
        "utilization": figures.get("utilization_pct"),
        "memory": 100.0 * used / total if used is not None and total else None,
        "temperature": figures.get("temperature_c"),
        "power": figures.get("power_w"),
    }


def sparkline_points(values: list[float], *, fixed_range: tuple[float, float] | None = None) -> str:
    """SVG polyline points for `values` in a SPARK_WIDTH × SPARK_HEIGHT box, newest at the right.
    Percentages use a fixed 0-100 scale; other figures scale to their own range."""
    if not values:
        return ""
    low, high = fixed_range or (min(values), max(values))
    if high - low < 1e-9:
        low, high = low - 1.0, high + 1.0
    step = SPARK_WIDTH / max(1, HISTORY_POINTS - 1)
    start = SPARK_WIDTH - step * (len(values) - 1)
    points = []
    for i, value in enumerate(values):
        share = (min(max(value, low), high) - low) / (high - low)
        points.append(f"{start + i * step:.1f},{SPARK_HEIGHT - 1 - share * (SPARK_HEIGHT - 2):.1f}")
    if len(points) == 1:  # one reading: a flat stub, so there is something to see
        points.insert(0, f"{SPARK_WIDTH - step:.1f},{points[0].split(',')[1]}")
    return " ".join(points)


def _gib(n: float) -> str:
    return f"{n / 1024**3:.1f}"


@dataclass(frozen=True)
class FigureView:
    name: str
    label: str
    text: str
    points: str
    available: bool


def figure_views(figures: dict[str, Any], history: list[list[float]] | None = None) -> list[FigureView]:
    """The four figures of one slot; `history` holds each figure's series in the same order."""
    values = _values(figures)
    history = history or [[], [], [], []]
    used, total = figures.get("memory_used_bytes"), figures.get("memory_total_bytes")
    texts = {
        "utilization": f"{values['utilization']:.0f}%" if values["utilization"] is not None else "—",
        "memory": f"{_gib(used)} / {_gib(total)} GiB" if values["memory"] is not None else "—",
        "temperature": f"{values['temperature']:.0f} °C" if values["temperature"] is not None else "—",
        "power": f"{values['power']:.0f} W" if values["power"] is not None else "—",
    }
    labels = {"utilization": "Utilisation", "memory": "Memory", "temperature": "Temperature", "power": "Power"}
    views = []
    for (name, value), series in zip(values.items(), history):
        series = series or ([value] if value is not None else [])
        fixed = (0.0, 100.0) if name in ("utilization", "memory") else None
        views.append(
            FigureView(
                name=name,
                label=labels[name],
                text=texts[name],
                points=sparkline_points(series, fixed_range=fixed),
                available=value is not None,
            )
        )
    return views


@dataclass
class ReplicaView:
    replica: Replica
    # 0-1 while loading, from the latest heartbeat; None when the worker has not reported it yet.
    load_progress: float | None
    # Its figures in the latest heartbeat (queue, running, KV cache, tokens/s), when reported.
    load: "ReplicaLoadView | None" = None

    @property
    def progress_pct(self) -> int:
        return round(100 * (self.load_progress or 0.0))


@dataclass(frozen=True)
class ReplicaLoadView:
    """A ready replica's engine figures, as the heartbeat reports them, in the page's words."""

    replica_id: int
    waiting: str
    running: str
    kv_cache: str
    tokens_per_s: str
    # Prompt tokens served from the prefix cache (either KV tier), and from the host tier alone.
    prefix_hits: str = "—"
    host_tier_hits: str = "—"
    # (tenant, percent) of the GPU's recent service, busiest first: the tenant's name ("tenant 12"
    # for an id with none, a deleted tenant), or "no tenant" for requests sent without one.
    tenant_shares: tuple[tuple[str, int], ...] = ()


def share_tenant_ids(live: dict[str, Any]) -> set[int]:
    """The tenants the heartbeat's replicas report shares of (whose names the page shows)."""
    return {
        int(tenant)
        for report in (live.get("replicas") or {}).values()
        for tenant in (report.get("tenant_shares") or {})
        if tenant and str(tenant).isdigit()
    }


def _tenant_label(tenant: str, names: dict[int, str]) -> str:
    if not tenant:
        return "no tenant"
    name = names.get(int(tenant)) if str(tenant).isdigit() else None
    return name or f"tenant {tenant}"


def replica_load_view(replica_id: int, report: dict[str, Any], names: dict[int, str] | None = None) -> ReplicaLoadView:
    """`names`: tenant names by id (accounts.selectors.tenant_names of share_tenant_ids)."""

    def count(name: str) -> str:
        value = report.get(name)
        return "—" if value is None else f"{value:.0f}"

    def share(name: str) -> str:
        value = report.get(name)
        return "—" if value is None else f"{100 * value:.0f}%"

    rate = report.get("tokens_per_s")
    return ReplicaLoadView(
        replica_id=replica_id,
        waiting=count("waiting"),
        running=count("running"),
        kv_cache=share("kv_cache_usage"),
        tokens_per_s="—" if rate is None else f"{rate:,.0f}",
        prefix_hits=share("prefix_cache_hit_rate"),
        host_tier_hits=share("host_cache_hit_rate"),
        tenant_shares=tuple(
            (_tenant_label(tenant, names or {}), round(100 * part))
            for tenant, part in sorted((report.get("tenant_shares") or {}).items(), key=lambda item: -item[1])
        ),
    )


def replica_loads(live: dict[str, Any], names: dict[int, str] | None = None) -> list[ReplicaLoadView]:
    """The figures of each replica the heartbeat reports ready; `names` as replica_load_view's."""
    return [
        replica_load_view(int(replica_id), report, names)
        for replica_id, report in (live.get("replicas") or {}).items()
        if report.get("state") == "ready"
    ]


@dataclass
class SlotView:
    worker_id: int
    key: str
    title: str
    figures: list[FigureView]
    replicas: list[ReplicaView] = field(default_factory=list)


def heartbeat_time(live: dict[str, Any]) -> datetime | None:
    """When the control plane received the worker's latest heartbeat."""
    received = live.get("received_at")
    return datetime.fromtimestamp(received, tz=timezone.utc) if received else None


def staging_view(live: dict[str, Any]) -> dict[str, Any] | None:
    """The heartbeat's staging report, with each checkpoint's folder name and resident percent."""
    staging = live.get("staging")
    if not staging:
        return None
    models = [
        {**m, "name": m["path"].rstrip("/").rpartition("/")[2], "resident_pct": round(100 * m["resident_fraction"])}
        for m in staging.get("models", [])
    ]
    return {"budget_bytes": staging.get("budget_bytes", 0), "models": models}


@dataclass
class WorkerView:
    worker: Worker
    slots: list[SlotView]
    heartbeat_at: datetime | None
    staging: dict[str, Any] | None = None

    @property
    def can_drain(self) -> bool:
        return self.worker.state == Worker.State.ONLINE


def _replica_progress(live: dict[str, Any], replica: Replica) -> float | None:
    report = (live.get("replicas") or {}).get(str(replica.pk))
    if report is None:
        return None
    return 1.0 if report.get("state") == "ready" else float(report.get("load_progress") or 0.0)


def worker_views(*, worker_ids: list[int] | None = None, history: FigureHistory | None = None) -> list[WorkerView]:
    workers = workers_with_live_replicas(worker_ids=worker_ids)
    live_by_worker = workers_latest_heartbeats(worker_ids=[w.pk for w in workers])
    views = []
    for worker in workers:
        live = live_by_worker.get(worker.pk, {})
        by_slot = _slot_figures(live)
        slots = []
        for gpu in worker.present_gpus:
            key = f"gpu{gpu.index}"
            slots.append(
                SlotView(
                    worker.pk,
                    key,
                    f"GPU {gpu.index} · {gpu.name}",
                    figure_views(by_slot.get(key, {}), _history(history, worker.pk, key)),
                )
            )
        slots.append(
            SlotView(
                worker.pk,
                CPU_SLOT,
                f"CPU · {worker.cpu_cores} cores",
                figure_views(by_slot.get(CPU_SLOT, {}), _history(history, worker.pk, CPU_SLOT)),
            )
        )
        by_gpu_id = {gpu.pk: slot for gpu, slot in zip(worker.present_gpus, slots)}
        names = tenant_names(tenant_ids=share_tenant_ids(live))
        for replica in worker.live_replicas:
            slot = by_gpu_id.get(replica.gpu_id, slots[-1]) if replica.gpu_id else slots[-1]
            report = (live.get("replicas") or {}).get(str(replica.pk))
            slot.replicas.append(
                ReplicaView(
                    replica,
                    _replica_progress(live, replica),
                    replica_load_view(replica.pk, report, names) if report else None,
                )
            )
        views.append(WorkerView(worker, slots, heartbeat_time(live), staging_view(live)))
    return views


def _history(history: FigureHistory | None, worker_id: int, slot: str) -> list[list[float]] | None:
    if history is None:
        return None
    return [history.series(worker_id, slot, name) for name in ("utilization", "memory", "temperature", "power")]


def live_slot_updates(live: dict[str, Any], history: FigureHistory) -> list[SlotView]:
    """The slots a heartbeat has figures for, with the history recorded so far (figures only)."""
    worker_id = live["worker_id"]
    return [
        SlotView(worker_id, key, "", figure_views(figures, _history(history, worker_id, key)))
        for key, figures in _slot_figures(live).items()
    ]


def loading_progress(live: dict[str, Any]) -> list[tuple[int, float]]:
    """(replica id, progress 0-1) for each replica the heartbeat reports still loading."""
    return [
        (int(replica_id), float(report.get("load_progress") or 0.0))
        for replica_id, report in (live.get("replicas") or {}).items()
        if report.get("state") == "loading"
    ]


@dataclass(frozen=True)
class AutoscaleView:
    """A deployment's autoscaling line: off, not decided yet, or its latest decision and why."""

    deployment_id: int
    enabled: bool
    action: str = ""
    desired_replicas: int | None = None
    reason: str = ""
    inputs: dict = field(default_factory=dict)
    decided_at: datetime | None = None

    @property
    def figures(self) -> list[tuple[str, str]]:
        """The inputs an operator reads first, as (label, text)."""
        i = self.inputs

        def show(key, fmt, scale=1.0):
            return "—" if i.get(key) is None else fmt.format(i[key] * scale)

        return [
            ("ready", f"{i.get('ready_replicas', '—')} of {i.get('current_replicas', '—')}"),
            ("utilisation", show("utilisation", "{:.0f}%", 100)),
            ("waiting", show("waiting", "{:.0f}")),
            ("running", show("running", "{:.0f}")),
            ("TTFT p95", show("ttft_p95_s", "{:.2f} s")),
            ("ITL p95", show("itl_p95_s", "{:.0f} ms", 1000)),
            ("KV cache", show("kv_cache_usage", "{:.0f}%", 100)),
            ("requests", show("request_rate_per_s", "{:.2f}/s")),
        ]


def autoscale_view_from_event(data: dict[str, Any]) -> AutoscaleView:
    """From the autoscaler's live event (no database work)."""
    return AutoscaleView(
        deployment_id=data["deployment_id"],
        enabled=True,
        action=data.get("action", ""),
        desired_replicas=data.get("desired_replicas"),
        reason=data.get("reason", ""),
        inputs=data.get("inputs") or {},
        decided_at=datetime.fromtimestamp(data["decided_at"], tz=timezone.utc) if data.get("decided_at") else None,
    )


def _autoscale_view(deployment) -> AutoscaleView:
    decision = getattr(deployment, "autoscale_decision", None)
    if decision is None or not deployment.autoscale:
        return AutoscaleView(deployment_id=deployment.pk, enabled=deployment.autoscale)
    return AutoscaleView(
        deployment_id=deployment.pk,
        enabled=True,
        action=decision.action,
        desired_replicas=decision.desired_replicas,
        reason=decision.reason,
        inputs=decision.inputs,
        decided_at=decision.decided_at,
    )


@dataclass
class DeploymentView:
    deployment: Any
    status: Any
    replicas: list[Replica]
    autoscale: AutoscaleView | None = None


def deployment_views(*, deployment_ids: list[int] | None = None) -> list[DeploymentView]:
    deployments = deployments_with_live_replicas(deployment_ids=deployment_ids)
    statuses = {s.deployment_id: s for s in deployment_statuses(deployment_ids=[d.pk for d in deployments])}
    return [DeploymentView(d, statuses[d.pk], d.live_replicas, _autoscale_view(d)) for d in deployments]
