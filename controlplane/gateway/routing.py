"""Which replicas can serve a model: a routing table cached per process and refreshed about once
a second. (Waiting for a replica to start: cold_start.py; the replica choice: replica_choice.py.)
"""

import asyncio
import logging
import time

from controlplane.gateway.body_check import ModelLimits
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.selectors import ModelRoute, routing_table

# An unknown model name triggers a refresh only if the table is at least this old, so a client
# asking for a model that does not exist cannot make every request a query.
_MISS_REFRESH_S = 0.25

logger = logging.getLogger(__name__)


class RoutingTable:
    def __init__(self, config: GatewayConfig, lane: DatabaseLane):
        self._config, self._lane = config, lane
        self._table: dict[str, ModelRoute] = {}
        self._limits: dict[str, ModelLimits] = {}
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

    async def model_limits(self) -> dict[str, ModelLimits]:
        """Each model's context and body limit by public name, to check bodies by before they are validated."""
        await self._fresh(self._config.routing_refresh_s)
        return self._limits

    async def fresh_model(self, name: str, max_age_s: float) -> ModelRoute | None:
        """The model's route from a table at most `max_age_s` old (for requests waiting on it)."""
        await self._fresh(max_age_s)
        return self._table.get(name)

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
            self._limits = {
                name: ModelLimits(route.context_length, route.max_request_bytes) for name, route in self._table.items()
            }
            self._fetched_at = started
        finally:
            self._refreshing = None
