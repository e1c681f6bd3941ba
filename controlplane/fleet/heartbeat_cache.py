"""Each worker's latest heartbeat (its registration until the first one arrives), kept in the shared
"live" cache (Redis in production) rather than the database: the dashboard, reconcile and lost-worker
detection read it; it changes every second. Pages hear of changes through `controlplane.live_events`.
The lost-worker judge keeps its watch here too (`lost_watch`)."""

from typing import Any

from django.core.cache import caches

# Long enough to outlive any silence we still reason about (lost, then offline); a missing entry
# is read as "silent since the worker's last state change, or since the lost-worker judge's watch
# began" (the watch is kept here too, so an emptied cache starts it again: see lost_watch).
_TTL_SECONDS = 24 * 3600
# Heartbeats' device figures kept per worker for the fleet page's sparklines: about a minute.
RECENT_FIGURES = 60


def _cache():
    return caches["live"]


def _key(worker_id: int) -> str:
    return f"fleet:worker:{worker_id}"


def store(*, worker_id: int, state: dict[str, Any]) -> None:
    _cache().set(_key(worker_id), state, _TTL_SECONDS)


def read(*, worker_id: int) -> dict[str, Any] | None:
    return _cache().get(_key(worker_id))


def read_many(*, worker_ids: list[int]) -> dict[int, dict[str, Any]]:
    found = _cache().get_many([_key(worker_id) for worker_id in worker_ids])
    return {worker_id: found[_key(worker_id)] for worker_id in worker_ids if _key(worker_id) in found}


def _staging_key(worker_id: int) -> str:
    return f"fleet:staging-sent:{worker_id}"


def staging_sent(*, worker_id: int) -> list[str] | None:
    """The last StageWeights list sent to the worker (None: none since the cache was emptied)."""
    return _cache().get(_staging_key(worker_id))


def store_staging_sent(*, worker_id: int, model_paths: list[str]) -> None:
    _cache().set(_staging_key(worker_id), model_paths, _TTL_SECONDS)


def _figures_key(worker_id: int) -> str:
    return f"fleet:figures:{worker_id}"


def store_figures(*, worker_id: int, figures: dict[str, Any]) -> None:
    """Add one heartbeat's device figures ({"received_at", "gpus", "cpu"}) to the worker's last
    RECENT_FIGURES, so a page opened now draws its sparklines with the last minute in them.

    Read, append, write: a worker's heartbeats arrive one at a time, and two that raced would at
    worst lose one point of a sparkline."""
    recent = _cache().get(_figures_key(worker_id)) or []
    _cache().set(_figures_key(worker_id), [*recent[-(RECENT_FIGURES - 1) :], figures], _TTL_SECONDS)


def recent_figures(*, worker_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Each worker's stored figures, oldest first."""
    found = _cache().get_many([_figures_key(worker_id) for worker_id in worker_ids])
    return {worker_id: found[_figures_key(worker_id)] for worker_id in worker_ids if _figures_key(worker_id) in found}


_LOST_WATCH_KEY = "fleet:lost-watch"


def lost_watch() -> dict[str, Any] | None:
    """The lost-worker judge's watch as stored (controlplane/fleet/lost_watch.py), or None: kept
    here, with the heartbeats, so a cache that comes back empty starts the watch again too."""
    return _cache().get(_LOST_WATCH_KEY)


def store_lost_watch(*, watch: dict[str, Any]) -> None:
    _cache().set(_LOST_WATCH_KEY, watch, _TTL_SECONDS)
