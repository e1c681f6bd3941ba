"""The embedded set-up's channel layer: in memory, and relayed between its processes.

Without Redis each process has a channel layer of its own, but live events are published where the
work happens (the fleet server records heartbeats, the Celery worker reconciles) while the pages
that show them are served by the web server. So every process's layer also sends its group
messages as one datagram to 127.0.0.1 on UDP port `relay_port` (the launcher gives every process
the web server's port number), where the web server's layer, which listens there from the first
page that joins a group, delivers them to its own groups. Best effort, as live events are: a lost
or oversized datagram is a page that catches up at its next event or resync.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket

from channels.layers import InMemoryChannelLayer

logger = logging.getLogger(__name__)

# The largest datagram sent: a UDP datagram on the loopback carries up to 65,507 bytes.
MAX_DATAGRAM_BYTES = 65_000


class RelayedInMemoryChannelLayer(InMemoryChannelLayer):
    def __init__(self, relay_port: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.relay_port = relay_port
        self._listener: asyncio.DatagramTransport | None = None
        self._could_not_listen = False
        self._sender: socket.socket | None = None

    async def group_add(self, group: str, channel: str) -> None:
        await super().group_add(group, channel)
        # A process whose pages join groups (the web server) receives the others' events.
        if self.relay_port and self._listener is None and not self._could_not_listen:
            try:
                self._listener, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                    lambda: _Receiver(self), local_addr=("127.0.0.1", self.relay_port)
                )
            except OSError:
                self._could_not_listen = True
                logger.warning(
                    "cannot receive live events from the other processes on UDP port %d; pages "
                    "show their changes when reloaded",
                    self.relay_port,
                    exc_info=True,
                )

    async def group_send(self, group: str, message: dict) -> None:
        await super().group_send(group, message)
        if self.relay_port and self._listener is None:
            self._relay(group, message)

    async def deliver(self, group: str, message: dict) -> None:
        """A group message relayed from another process, to this process's groups only."""
        await super().group_send(group, message)

    def _relay(self, group: str, message: dict) -> None:
        data = json.dumps({"group": group, "message": message}).encode()
        if len(data) > MAX_DATAGRAM_BYTES:
            logger.debug("a live event for %s is too large to relay (%d bytes)", group, len(data))
            return
        if self._sender is None:
            self._sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sender.setblocking(False)
        try:
            self._sender.sendto(data, ("127.0.0.1", self.relay_port))
        except OSError:  # nobody listens yet, or the socket's buffer is full
            logger.debug("could not relay a live event for %s", group, exc_info=True)


class _Receiver(asyncio.DatagramProtocol):
    def __init__(self, layer: RelayedInMemoryChannelLayer):
        self.layer = layer

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            relayed = json.loads(data)
            group, message = relayed["group"], relayed["message"]
            self.layer.require_valid_group_name(group)
            if not isinstance(message, dict):
                raise TypeError("the message is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            logger.debug("ignored a malformed live event datagram: %s", exc)
            return
        asyncio.ensure_future(self.layer.deliver(group, message))
