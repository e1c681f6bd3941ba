"""Live events for the dashboards: the one wrapper around the channel layer that services publish
through, to a Channels group the pages' consumers join.

Events go out only after the surrounding transaction commits, so a page never shows a change that
was rolled back. A consumer receives {"type": "live.event", "event": NAME, "data": {...}} where
`data` holds only JSON types.
"""

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

FLEET_GROUP = "fleet"


def publish(*, group: str, event: str, data: dict[str, Any]) -> None:
    def send() -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            async_to_sync(layer.group_send)(group, {"type": "live.event", "event": event, "data": data})
        except Exception:
            # Live views are best effort: a full or unreachable channel layer must never fail the
            # write that already committed.
            logger.warning("could not publish %s to group %s", event, group, exc_info=True)

    transaction.on_commit(send)
