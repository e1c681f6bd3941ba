"""Asking a silent worker's replicas whether they still run: the lost-worker judge's evidence that
the worker stopped, and not only the control plane's recording of its heartbeats.

A replica server exits with the daemon that started it (`serve --exit-with-parent`: Linux's
parent-death signal), so one that answers its `/health` as loading or ready shows that its worker
runs. One that refuses, times out or answers anything else shows nothing; nor does one draining,
as a replica does once its daemon is gone (or when it is being unloaded).
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx

# Each replica gets this long to connect and answer; the check runs every second.
PROBE_TIMEOUT_S = 1.0
RUNNING = ("loading", "ready")


def any_replica_answers(*, endpoint_urls: Iterable[str], token: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether any of these replica servers answers `GET /health` as loading or ready (the bearer
    `token` is the fleet's worker token, which replicas ask of every caller)."""
    with httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"}) as client:
        for url in endpoint_urls:
            try:
                answer = client.get(f"{url.rstrip('/')}/health").json()
            except (httpx.HTTPError, ValueError):
                continue
            if isinstance(answer, dict) and answer.get("status") in RUNNING:
                return True
    return False
