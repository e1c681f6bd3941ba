"""The replica process: uvicorn serving the replica app (app.py), draining on SIGTERM, and stopping
with the daemon that started it.

    run_server(ServerConfig(...), host="127.0.0.1", port=8100)
    run_server(ServerConfig(...), host="127.0.0.1", port=8100, fd=3)  # a socket the daemon bound
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket

import uvicorn

from gpuworker.replica.app import build_app
from gpuworker.replica.engine_holder import EngineHolder, ServerConfig

logger = logging.getLogger(__name__)

# After the drain deadline aborted what was left, responses get this long to reach their clients.
DRAIN_GRACE_S = 5.0


class _DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT and only then stops; a second one stops now."""

    def __init__(self, config: uvicorn.Config, holder: EngineHolder) -> None:
        super().__init__(config)
        self.holder = holder
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._drain_started or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._drain_started = True
        # A signal handler may not touch the loop directly: hand the drain over to it.
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        self.holder.begin_drain(self.holder.config.drain_timeout_s)
        await self.holder.wait_drained(DRAIN_GRACE_S)
        self.should_exit = True


class _QuietPolls(logging.Filter):
    """Drops access-log lines of /health and /stats, which the daemon polls twice a second."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and args[2] in ("/health", "/stats"))


def run_server(
    config: ServerConfig,
    *,
    host: str,
    port: int,
    fd: int | None = None,
    log_level: str = "info",
    holder: EngineHolder | None = None,
) -> None:
    """Serve on host:port, or on the inherited socket `fd` (bound already; host and port then only
    name it). uvicorn's own `fd` option takes the socket for a Unix one, so it is handed over as a
    socket object. `holder`: an engine already loading (started before the server's imports)."""
    logging.getLogger("uvicorn.access").addFilter(_QuietPolls())
    app = build_app(config, holder)
    server = _DrainingServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(DRAIN_GRACE_S)),
        app.state.holder,
    )
    if fd is None:
        server.run()
        return
    sock = socket.socket(fileno=fd)  # family and type read from the descriptor
    logger.info("serving on %s (socket from the daemon)", sock.getsockname())
    server.run(sockets=[sock])


def exit_with_parent(parent_pid: int) -> None:
    """Have Linux SIGTERM this replica when the daemon thread that started it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        logger.warning("cannot ask to be stopped with the daemon (no prctl here)")
        return
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
