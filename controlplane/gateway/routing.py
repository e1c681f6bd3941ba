"""Which replicas can serve a model: a routing table cached per process and refreshed about once
a second, waiting (boundedly) for replicas that are still loading.
"""

import asyncio
import logging
import time

from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.errors import unavailable
from controlplane.gateway.selectors import ModelRoute, ReplicaRoute, routing_table

# An unknown model name triggers a refresh only if the table is at least this old, so a client
# asking for a model that does not exist cannot make every request a query.
_MISS_REFRESH_S = 0.25
_WAIT_POLL_S = 0.25

logger = logging.getLogger(__name__)


class RoutingTable:
    def __init__(self, config: GatewayConfig, lane: DatabaseLane):
        self._config, self._lane = config, lane
        self._table: dict[str, ModelRoute] = {}
        self._fetched_at = float("-inf")
        self._refreshing: asyncio.Task | None = None

    async def models(self) -> list[ModelRoute]:
        await self._fresh(self._config.routing_refresh_s)
        return list(self._table.values())

    async def model(self, name: str) -> ModelRoute | None:
        await self._fresh(self._config.routing_refresh_s)
        route = self._table.get(name)
        if route is None:
            await self._fresh(_MISS_REFRESH_S)
            route = self._table.get(name)
        return route

    async def ready_replicas(self, name: str) -> tuple[ReplicaRoute, ...]:
        """The model's ready replicas; while none is ready but some are loading, waits for one up
        to GATEWAY_REPLICA_WAIT_SECONDS; then raises 503 with retry-after."""
        deadline = time.monotonic() + self._config.replica_wait_s
        while True:
            route = self._table.get(name)
            if route is not None and route.ready:
                return route.ready
            if route is None or not route.loading or time.monotonic() >= deadline:
                state = "is still loading" if route is not None and route.loading else "has no replica ready"
                raise unavailable(f"The model {name!r} {state}; try again shortly.", self._config.retry_after_s)
            await asyncio.sleep(_WAIT_POLL_S)
            await self._fresh(_WAIT_POLL_S)

    async def _fresh(self, max_age_s: float) -> None:
        if time.monotonic() - self._fetched_at < max_age_s:
            return
        if self._refreshing is None:  # one query however many requests find the table stale
            self._refreshing = asyncio.ensure_future(self._refresh())
        try:
            await asyncio.shield(self._refreshing)
        except Exception:
            if not self._table:
                raise
            # Serving from a slightly stale table beats failing every request while the
            # database is unreachable; the next request tries again.
            logger.warning("could not refresh the routing table; using the previous one", exc_info=True)

    async def _refresh(self) -> None:
        try:
            started = time.monotonic()
            self._table = await self._lane.run(routing_table)
            self._fetched_at = started
        finally:
            self._refreshing = None

