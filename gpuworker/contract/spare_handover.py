"""How the daemon hands a load to a spare replica process (gpuworker/replica/spare.py), written once
for both sides: one message on a SOCK_SEQPACKET Unix socket pair holding the `serve` arguments as a
JSON list of strings (without --fd), with two file descriptors attached: the listening socket the
daemon bound for the replica and the replica's log file. The daemon closing its end instead tells
the spare that no load will come.
"""

from __future__ import annotations

import json
import os
import socket

# One load's arguments: a JSON list of `serve` arguments, far below this.
MESSAGE_BYTES = 1 << 16
# What a spare logs once its imports and device are ready (tools wait for it).
READY_LINE = "spare replica process ready"


def send_load(control: socket.socket, serve_argv: list[str], listener_fd: int, log_fd: int) -> None:
    socket.send_fds(control, [json.dumps(serve_argv).encode()], [listener_fd, log_fd])


def receive_load(control: socket.socket) -> tuple[list[str], int, int] | None:
    """Block until the daemon hands over a load: (serve argv, listener fd, log fd); None when the
    daemon closed its end instead."""
    message, fds, _flags, _address = socket.recv_fds(control, MESSAGE_BYTES, 2)
    if not message or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        if not message:
            return None
        raise ValueError(f"a spare expects 2 file descriptors with its load, got {len(fds)}")
    argv = json.loads(message)
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a spare's load must be a list of strings, got {message[:200]!r}")
    return argv, fds[0], fds[1]
