"""Replica kills for the bench's fault runs (bench/chaos.py on PostgreSQL and Redis, bench/embedded_storm.py
on the embedded default). A ready replica's process is found by the pid its worker's daemon reports in
heartbeats (as the control plane recorded them), never by process name, and is signalled only while it is
a child of that daemon. A kill has acted only once the control plane records the replica failed and a
replica of its deployment created after it is ready."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ReplicaProcess:
    """A ready replica and the process its daemon reports serving it."""

    replica_id: int
    deployment_id: int
    worker: str
    endpoint_url: str
    pid: int


@dataclass
class ReplicaKill:
    target: ReplicaProcess
    killed: bool  # whether the signal was sent (the process may have gone before)
    killed_at: float  # time.monotonic()
    failure_seen: str = ""  # the replica's recorded failure and error
    failed_seen_s: float | None = None  # from the kill until the control plane recorded the replica failed
    replaced_by: int | None = None  # a replica of its deployment created after the kill, ready
    replaced_s: float | None = None  # from the kill until then
    # Why the kill did not do what it is for (nothing was killed, or its effect was never seen); empty
    # when it did.
    problem: str = ""


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, dead but not yet reaped, is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def is_child(pid: int, parent: int) -> bool:
    """Whether `pid` is a live (not zombie) child of `parent`: a pid the host reused for some other
    process is never signalled."""
    try:
        process = psutil.Process(pid)
        return process.ppid() == parent and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def replica_processes(*, deployment_ids: Iterable[int], daemons: dict[str, int]) -> list[ReplicaProcess]:
    """The ready replicas of these deployments whose daemon (`daemons`: worker name -> the daemon's pid,
    running) reports the process serving them, a child of that daemon."""
    from controlplane.fleet.models import Replica
    from controlplane.fleet.selectors import workers_latest_heartbeats

    ready = list(
        Replica.objects.filter(deployment_id__in=list(deployment_ids), state=Replica.State.READY)
        .select_related("worker")
        .order_by("pk")
    )
    latest = workers_latest_heartbeats(worker_ids={replica.worker_id for replica in ready})
    found = []
    for replica in ready:
        report = ((latest.get(replica.worker_id) or {}).get("replicas") or {}).get(str(replica.pk)) or {}
        pid, daemon = report.get("pid"), daemons.get(replica.worker.name)
        if report.get("state") == "ready" and pid and daemon and is_child(pid, daemon):
            found.append(
                ReplicaProcess(
                    replica.pk, replica.deployment_id, replica.worker.name, report.get("endpoint_url", ""), pid
                )
            )
    return found


def kill_replica(target: ReplicaProcess, *, failed_wait_s: float, replaced_wait_s: float) -> ReplicaKill:
    """SIGKILL the target's process, then wait for the control plane to record the replica failed and
    for a replica of its deployment created after the kill to be ready."""
    newest = poll(lambda: _newest_replica_id(target.deployment_id), failed_wait_s)
    now = time.monotonic()
    if newest is None:
        return ReplicaKill(
            target,
            False,
            now,
            problem=f"the replicas of deployment {target.deployment_id} could not be read within {failed_wait_s:g}s",
        )
    try:
        os.kill(target.pid, signal.SIGKILL)
    except ProcessLookupError:
        return ReplicaKill(
            target, False, now, problem=(f"replica {target.replica_id}'s process {target.pid} was gone before the kill")
        )
    kill = ReplicaKill(target, True, now)
    failed = poll(lambda: _recorded_failure(target.replica_id), failed_wait_s)
    if failed is None:
        kill.problem = f"replica {target.replica_id} was not recorded failed within {failed_wait_s:g}s"
        return kill
    kill.failed_seen_s, kill.failure_seen = time.monotonic() - now, failed
    kill.replaced_by = poll(lambda: _ready_since(target.deployment_id, newest), replaced_wait_s)
    if kill.replaced_by is None:
        kill.problem = f"no new replica was ready within {replaced_wait_s:g}s of the kill"
    else:
        kill.replaced_s = time.monotonic() - now
    return kill


def poll(look, timeout: float):
    """`look()`'s first truthy answer within `timeout` seconds, else None. An error counts as no answer:
    the database or Redis may still be coming back from a fault before (or SQLite busy with a writer)."""
    from django.db import connection

    deadline = time.monotonic() + timeout
    while True:
        try:
            if found := look():
                return found
        except Exception:  # noqa: BLE001 - a service still restarting; the deadline bounds it
            connection.close()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def _newest_replica_id(deployment_id: int) -> int | None:
    from controlplane.fleet.models import Replica

    return Replica.objects.filter(deployment_id=deployment_id).order_by("-pk").values_list("pk", flat=True).first()


def _recorded_failure(replica_id: int) -> str | None:
    from controlplane.fleet.models import Replica

    replica = Replica.objects.get(pk=replica_id)
    if replica.state != Replica.State.FAILED:
        return None
    return f"{replica.failure}: {replica.last_error[:120]}"


def _ready_since(deployment_id: int, newest: int) -> int | None:
    """A ready replica of the deployment created after the one numbered `newest`."""
    from controlplane.fleet.models import Replica

    return (
        Replica.objects.filter(deployment_id=deployment_id, state=Replica.State.READY, pk__gt=newest)
        .values_list("pk", flat=True)
        .first()
    )
