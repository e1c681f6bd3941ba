"""What one gateway process holds (`Gateway`): caches, clients, database lanes and chores, built
at the app's startup (else on its first request) and closed with the app. The routes (app.py) and the request path
(completions.py) take it as their first argument."""

import asyncio
import logging
import uuid

from controlplane.fleet.traffic import traffic_recorder
from controlplane.gateway.body_parsing import BodyParsers
from controlplane.gateway.cold_start import ColdStartQueue
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.holds import HoldPlacer, settle_batcher, sweep_expired_holds
from controlplane.gateway.keys import KeyCache
from controlplane.gateway.refusals import RefusalLog
from controlplane.gateway.routing import RoutingTable
from controlplane.gateway.upstream import UpstreamPool

logger = logging.getLogger(__name__)


class Gateway:
    """Everything one gateway process holds: caches, clients, database lanes, chores."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        # Names this process in the claims it holds on work that outlives a request (background responses).
        self.process_id = uuid.uuid4().hex
        # Admission work (holds, key and routing reads) and settlements get a connection each, so
        # a slow batch of one does not queue behind the other.
        self.admit_lane, self.settle_lane = DatabaseLane("admit"), DatabaseLane("settle")
        # The Files and Batch APIs' reads and writes (uploads copied to storage among them).
        self.files_lane = DatabaseLane("files")
        self.keys = KeyCache(config, self.admit_lane)
        self.routing = RoutingTable(config, self.admit_lane)
        self.upstream = UpstreamPool(connect_timeout_s=config.connect_timeout_s)
        self.bodies = BodyParsers(
            workers=config.body_parsers,
            per_tenant=config.body_parsers_per_tenant,
            inline_bytes=config.inline_body_bytes,
            retry_after_s=config.retry_after_s,
        )
        self.holds = HoldPlacer(self.admit_lane, config.hold_lifetime_s)
        self.settles = settle_batcher(self.settle_lane)
        self.refusals = RefusalLog(self.settle_lane, config.refusal_flush_s)
        self.shared = shared_state(config)
        # Requests per model for the autoscaler (Redis, or this process without it).
        self.traffic = traffic_recorder(config.redis_url)
        self.cold_starts = ColdStartQueue(config, self.routing, self.shared, self.admit_lane)
        self._spawned: set[asyncio.Task] = set()
        self._chores = [
            asyncio.ensure_future(self.keys.follow_changes()),
            # Announcements only hurry the reads; after a gap the next read covers what was missed.
            asyncio.ensure_future(
                self.shared.listen_key_changes(self.keys.change_announced, self.keys.read_changes_now)
            ),
            asyncio.ensure_future(sweep_expired_holds(self)),
        ]

    def add_chore(self, work) -> None:
        """Run `work` (a loop) for as long as this process serves, cancelled when it closes."""
        self._chores.append(asyncio.ensure_future(work))

    def spawn(self, work) -> None:
        """Run `work` in the background (settlements after the answer went out); kept until done."""
        task = asyncio.ensure_future(work)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        task.add_done_callback(_log_failure)

    async def aclose(self) -> None:
        for chore in self._chores:
            chore.cancel()
        await asyncio.gather(*self._chores, return_exceptions=True)
        if self._spawned:  # settlements still being written
            await asyncio.wait(self._spawned, timeout=30)
        await self.refusals.aclose()
        self.upstream.close()
        self.bodies.close()
        await self.holds.aclose()
        await self.shared.aclose()
        await self.traffic.aclose()
        self.admit_lane.close()
        self.settle_lane.close()
        self.files_lane.close()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        # A settlement that failed leaves its hold to the sweeper, which charges it as cancelled.
        logger.error("background work failed", exc_info=task.exception())


def shared_state(config: GatewayConfig):
    if config.redis_url:
        from controlplane.gateway.shared import RedisShared

        return RedisShared(config)
    from controlplane.gateway.local_shared import LocalShared

    return LocalShared(config)
