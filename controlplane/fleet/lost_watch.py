"""The lost-worker judge's watch: the time over which the judge (the beat task `mark_lost_workers`)
demonstrably ran, so that a worker's silence is counted only over time when the control plane
could have recorded its heartbeats. Pure: the record lives in the live cache
(`heartbeat_cache.lost_watch`), the judgement in `services.workers_mark_lost`.

A heartbeat is recorded through the same database and cache the check needs. A check that could
not run (the database, the cache or the broker down; Celery or beat stopped or too busy) leaves a
gap; after a gap longer than a lost window, or when the cache no longer holds the record (Redis
restarted empty, or flushed), the watch starts again at that check, and no worker's silence counts
from before it. A worker is then lost at the earliest a whole lost window after the control plane
came back, whatever it missed meanwhile. The other half of the judgement, for a control plane that
runs the check but cannot record heartbeats (too busy, or unable to write them), is
`replica_probe.py`: a silent worker whose replicas answer is held, not lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Why the judgement is paused, as the metric `gpuserve_fleet_lost_judgement_paused` labels it.
CHECK_NOT_RUNNING = "check_not_running"  # no check completed for a lost window: no one can be judged
WATCH_RESUMED = "watch_resumed"  # the watch started again less than a lost window ago
REPLICAS_ANSWER = "replicas_answer"  # a silent worker's replicas answer: it runs, its heartbeats go unrecorded
PAUSE_REASONS = (CHECK_NOT_RUNNING, WATCH_RESUMED, REPLICAS_ANSWER)


@dataclass(frozen=True)
class Watch:
    since: float  # when this unbroken watch began (epoch seconds)
    checked_at: float  # when the latest check that completed began
    # Workers silent past the lost threshold whose replicas still answer, each since when.
    held: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "checked_at": self.checked_at,
            "held": {str(worker_id): at for worker_id, at in self.held.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> Watch | None:
        """The stored watch, or None for none (or one this code cannot read: a new watch starts)."""
        try:
            return cls(
                since=float(data["since"]),
                checked_at=float(data["checked_at"]),
                held={int(worker_id): float(at) for worker_id, at in (data.get("held") or {}).items()},
            )
        except (TypeError, KeyError, ValueError, AttributeError):
            return None


def watch_resume(previous: Watch | None, *, now: float, max_gap_s: float) -> tuple[Watch, str | None]:
    """This check's watch: `previous` continued, or a new one from `now`. Returns it and, when it
    starts again, why (for the log)."""
    if previous is None:
        return Watch(since=now, checked_at=now), "the cache holds no watch (a first check, or the cache was emptied)"
    gap = now - previous.checked_at
    if gap > max_gap_s:
        return Watch(since=now, checked_at=now), f"no check completed for {gap:.1f} s"
    return previous, None


def paused_reasons(watch: Watch | None, *, now: float, lost_after_s: float) -> list[str]:
    """Why no worker (or not every worker) can be judged lost at `now`; empty: none."""
    if watch is None or now - watch.checked_at > lost_after_s:
        return [CHECK_NOT_RUNNING]
    reasons = []
    if now - watch.since < lost_after_s:
        reasons.append(WATCH_RESUMED)
    if watch.held:
        reasons.append(REPLICAS_ANSWER)
    return reasons
