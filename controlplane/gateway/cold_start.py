"""Cold starts that wait instead of failing: a request for a model with no ready replica waits in a
bounded queue (per model, per gateway process) while one loads, and asks the fleet to start one if
none is loading (`controlplane.fleet.services.deployments.deployment_wake`). Every process counts its waiting
requests in the shared state, where the autoscaler reads them (`cold_start_counts`).
"""

import asyncio
import logging
import time
from collections import Counter

from controlplane.fleet.services.deployments import deployment_wake
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.errors import unavailable
from controlplane.gateway.routing import RoutingTable
from controlplane.gateway.selectors import ModelRoute, ReplicaRoute

# The answer to a request that waited for a replica to start says so, and for how long (seconds).
HEADER = "x-gpuserve-cold-start"
# How often a waiting request looks at the routing table again.
_POLL_S = 0.25
# A process asks the fleet to wake a model at most this often: the service is cheap when the
# deployment is awake, but hundreds of waiting requests must not each make a query per poll.
_WAKE_EVERY_S = 5.0

logger = logging.getLogger(__name__)


def cold_start_header(waited_s: float | None) -> dict[str, str]:
    return {} if waited_s is None else {HEADER: f"{waited_s:.1f}"}


class ColdStartQueue:
    """This process's requests waiting for a model's first ready replica."""

    def __init__(self, config: GatewayConfig, routing: RoutingTable, shared, lane: DatabaseLane):
        self._config, self._routing, self._shared, self._lane = config, routing, shared, lane
        self._waiting: Counter[int] = Counter()  # model id -> requests waiting here
        self._woken_at: dict[int, float] = {}

    async def ready_replicas(self, model: ModelRoute, request_id: str) -> tuple[tuple[ReplicaRoute, ...], float | None]:
        """The model's ready replicas, and how long the request waited for them (None: it did not).

        With none ready, waits up to GATEWAY_COLD_START_WAIT_SECONDS for one, waking the model's
        deployment if nothing is loading. 503 at once when no replica can be started or the queue
        holds GATEWAY_COLD_START_QUEUE_MAX requests already; 503 with the wait's header when it
        ends without a replica. Cancelling it (the client left) gives up its place."""
        if model.ready:
            return model.ready, None
        _refuse_if_unservable(model, self._config.retry_after_s)
        if self._waiting[model.model_id] >= self._config.cold_start_queue_max:
            raise unavailable(
                f"The model {model.public_name!r} is starting and {self._waiting[model.model_id]} "
                f"requests are already waiting for it (GATEWAY_COLD_START_QUEUE_MAX); try again "
                f"shortly.",
                self._config.retry_after_s,
                code="cold_start_queue_full",
            )
        started = time.monotonic()
        deadline = started + self._config.cold_start_wait_s
        self._waiting[model.model_id] += 1
        try:
            await self._shared.cold_start_join(model.model_id, request_id, self._config.cold_start_wait_s)
            route = model
            while True:
                if not route.loading:
                    await self._wake(route)
                await asyncio.sleep(_POLL_S)
                route = await self._routing.fresh_model(model.public_name, _POLL_S)
                if route is None:
                    raise unavailable(
                        f"The model {model.public_name!r} was disabled while the request waited for it to start.",
                        self._config.retry_after_s,
                    )
                if route.ready:
                    return route.ready, time.monotonic() - started
                _refuse_if_unservable(route, self._config.retry_after_s)
                if time.monotonic() >= deadline:
                    error = unavailable(
                        f"No replica of {model.public_name!r} became ready within {self._config.cold_start_wait_s:g} s "
                        f"(GATEWAY_COLD_START_WAIT_SECONDS); it is still starting: try again shortly.",
                        self._config.retry_after_s,
                        code="cold_start_timeout",
                    )
                    error.headers.update(cold_start_header(time.monotonic() - started))
                    raise error
        finally:
            self._waiting[model.model_id] -= 1
            if not self._waiting[model.model_id]:
                del self._waiting[model.model_id]
            try:
                await self._shared.cold_start_leave(model.model_id, request_id)
            except Exception:  # its entry expires at the wait's deadline anyway
                logger.warning("could not take request %s off the cold-start count", request_id, exc_info=True)

    async def _wake(self, model: ModelRoute) -> None:
        now = time.monotonic()
        if now - self._woken_at.get(model.model_id, float("-inf")) < _WAKE_EVERY_S:
            return
        self._woken_at[model.model_id] = now  # before the call: the other waiters need not ask too
        try:
            can_start = await self._lane.run(deployment_wake, model_id=model.model_id)
        except Exception:
            del self._woken_at[model.model_id]  # the next poll asks again
            raise
        if not can_start:
            raise unavailable(
                f"The model {model.public_name!r} has no replica ready and none can be started: "
                f"its deployment allows no replicas.",
                self._config.retry_after_s,
            )


def _refuse_if_unservable(model: ModelRoute, retry_after_s: int) -> None:
    if not model.servable:
        raise unavailable(
            f"The model {model.public_name!r} has no replica ready and none can be started: {model.cannot_start}.",
            retry_after_s,
        )
