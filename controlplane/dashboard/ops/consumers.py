"""The fleet page's WebSocket (ws/fleet/): operators and admins only. It joins the "fleet" group
the fleet services publish to and relays each event as HTML fragments addressed by id; it keeps the
last minute of figures per open page for the sparklines, starting from the fleet's recent ones. A
page that reconnects asks to resync.

The operators' home (ws/home/fleet/) listens to the same group and redraws its fleet section."""

import asyncio
import json
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.template.loader import render_to_string
from django.utils import timezone

from controlplane.accounts.selectors import tenant_names
from controlplane.dashboard.home import operator_home
from controlplane.dashboard.ops import fragments
from controlplane.dashboard.ops.overview import FigureHistory, share_tenant_ids
from controlplane.dashboard.permissions import OPERATOR_ROLES, has_role
from controlplane.live_events import FLEET_GROUP

logger = logging.getLogger(__name__)

FORBIDDEN = 4403


async def _tenant_names(tenant_ids: set[int]) -> dict[int, str]:
    """Names of the tenants a heartbeat's replicas serve: none to look up, no thread hop; else
    accounts' cached lookup (a query only for names not yet cached)."""
    if not tenant_ids:
        return {}
    return await database_sync_to_async(tenant_names)(tenant_ids=tenant_ids)


class FleetConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not has_role(user, OPERATOR_ROLES):
            await self.close(code=FORBIDDEN)
            return
        self.history = FigureHistory()
        await self.channel_layer.group_add(FLEET_GROUP, self.channel_name)
        # Joined first, then seeded: a heartbeat in between is drawn twice rather than missed.
        self.history = await database_sync_to_async(FigureHistory.recent)()
        await self.accept()

    async def disconnect(self, code) -> None:
        if hasattr(self, "history"):
            await self.channel_layer.group_discard(FLEET_GROUP, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None) -> None:
        """The page only listens, except for {"resync": true} after it reconnects: it gets the
        workers and every deployment's status as they are now. Anything else is ignored."""
        try:
            message = json.loads(text_data or "")
        except ValueError:
            return
        if isinstance(message, dict) and message.get("resync") is True:
            html = await database_sync_to_async(fragments.resync_fragment)(self.history)
            await self.send(text_data=html)

    async def live_event(self, message: dict) -> None:
        event, data = message.get("event"), message.get("data") or {}
        try:
            if event == "worker.heartbeat":
                self.history.record(data)
                names = await _tenant_names(share_tenant_ids(data))
                html = fragments.heartbeat_fragment(data, self.history, names)
            elif event == "replica.state":
                html = await database_sync_to_async(fragments.replica_change_fragment)(data, self.history)
            elif event == "autoscale.decision":
                html = fragments.autoscale_fragment(data)
            elif event == "worker.state":
                html = await database_sync_to_async(fragments.workers_fragment)(self.history)
            elif event == "deployment.changed":
                html = await database_sync_to_async(fragments.deployment_fragment)(data)
            else:
                return
        except Exception:
            # One malformed or stale event must not close every operator's live page.
            logger.exception("could not render the fleet page's %s event", event)
            return
        if html.strip():
            await self.send(text_data=html)


def home_fleet_fragment() -> str:
    return render_to_string("dashboard/home/_operator.html", {"home": operator_home(now=timezone.now()), "live": True})


class HomeFleetConsumer(AsyncWebsocketConsumer):
    """The operators' home section, live: drawn on connecting (so a reconnected page is current),
    then again after fleet events, at most once per `redraw_interval_s` (each worker beats every
    second, and the section reads the whole fleet); the last event of a burst is always drawn."""

    redraw_interval_s = 2.0

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not has_role(user, OPERATOR_ROLES):
            await self.close(code=FORBIDDEN)
            return
        self.redraw: asyncio.Task | None = None
        self.drawn_at = float("-inf")
        await self.channel_layer.group_add(FLEET_GROUP, self.channel_name)
        await self.accept()
        await self._draw()

    async def disconnect(self, code) -> None:
        if hasattr(self, "redraw"):
            if self.redraw is not None:
                self.redraw.cancel()
            await self.channel_layer.group_discard(FLEET_GROUP, self.channel_name)

    async def live_event(self, message: dict) -> None:
        if self.redraw is None or self.redraw.done():
            self.redraw = asyncio.ensure_future(self._draw_after_interval())

    async def _draw_after_interval(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, self.drawn_at + self.redraw_interval_s - loop.time()))
        await self._draw()

    async def _draw(self) -> None:
        self.drawn_at = asyncio.get_running_loop().time()
        try:
            html = await database_sync_to_async(home_fleet_fragment)()
        except Exception:
            logger.exception("could not draw the home page's fleet section")
            return
        await self.send(text_data=html)
