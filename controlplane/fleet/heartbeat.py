"""How one heartbeat's replica reports change the recorded replicas: a pure plan (no ORM), which
the heartbeat service applies. Most heartbeats change nothing and so write nothing."""

from dataclasses import dataclass, field

from gpuworker.contract.heartbeat import ReplicaReport

PENDING, LOADING, READY, DRAINING, STOPPED, FAILED = "pending", "loading", "ready", "draining", "stopped", "failed"

# (recorded state, reported state) -> the recorded state's path along the state machine.
# Reports can skip states a heartbeat never saw (a load can finish between two beats), so the
# path walks through them rather than jumping, and every step stays a legal transition.
_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
    (PENDING, LOADING): (LOADING,),
    (PENDING, READY): (LOADING, READY),
    (PENDING, DRAINING): (LOADING, DRAINING),
    (PENDING, STOPPED): (STOPPED,),
    (LOADING, READY): (READY,),
    (LOADING, DRAINING): (DRAINING,),
    (LOADING, STOPPED): (DRAINING, STOPPED),
    (READY, DRAINING): (DRAINING,),
    (READY, STOPPED): (DRAINING, STOPPED),
    (DRAINING, STOPPED): (STOPPED,),
}
_LIVE = (PENDING, LOADING, READY, DRAINING)
# The worker still runs it, but the control plane wants it gone (its unload message was lost,
# or the control plane gave up on it, e.g. while the worker was lost).
_UNLOAD = {
    (DRAINING, LOADING),
    (DRAINING, READY),
    (STOPPED, LOADING),
    (STOPPED, READY),
    (FAILED, LOADING),
    (FAILED, READY),
}


@dataclass(frozen=True)
class RecordedReplica:
    replica_id: int
    state: str


@dataclass(frozen=True)
class Step:
    replica_id: int
    path: tuple[str, ...]
    endpoint_url: str | None = None
    error: str = ""
    failure: str = ""


@dataclass
class HeartbeatPlan:
    steps: list[Step] = field(default_factory=list)
    unload: list[int] = field(default_factory=list)


def plan_heartbeat(*, recorded: list[RecordedReplica], reported: list[ReplicaReport]) -> HeartbeatPlan:
    """`recorded`: this worker's live replicas plus any it reported, as the database has them."""
    plan = HeartbeatPlan()
    by_id = {r.replica_id: r for r in recorded}
    for report in reported:
        mine = by_id.get(report.replica_id)
        if mine is None:
            # Not ours (or not this worker's): whatever it is, it should not be running.
            if report.state in (LOADING, READY):
                plan.unload.append(report.replica_id)
            continue
        if (mine.state, report.state) in _UNLOAD:
            plan.unload.append(report.replica_id)
        elif report.state == FAILED and mine.state in _LIVE:
            plan.steps.append(
                Step(
                    mine.replica_id,
                    (FAILED,),
                    error=report.error or "The worker reported the replica failed without giving a reason.",
                    failure="load" if mine.state in (PENDING, LOADING) else "crashed",
                )
            )
        elif (mine.state, report.state) in _PATHS:
            plan.steps.append(
                Step(
                    mine.replica_id,
                    _PATHS[(mine.state, report.state)],
                    endpoint_url=report.endpoint_url or None,
                )
            )
    reported_ids = {report.replica_id for report in reported}
    for mine in recorded:
        if mine.replica_id in reported_ids:
            continue
        # A pending replica's load message may simply not have arrived yet (the acknowledgement
        # timeout covers a lost one); anything else the worker forgot is gone.
        if mine.state in (LOADING, READY):
            plan.steps.append(
                Step(
                    mine.replica_id,
                    (FAILED,),
                    failure="vanished",
                    error="The worker stopped reporting this replica (its daemon may have restarted).",
                )
            )
        elif mine.state == DRAINING:
            plan.steps.append(Step(mine.replica_id, (STOPPED,)))
    return plan
