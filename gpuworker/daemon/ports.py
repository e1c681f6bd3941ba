"""Replica listening sockets, bound by the daemon and handed to the child process.

Choosing a free port and letting the child bind it later leaves a window in which another process
can take it (the child then dies on `[Errno 98] address already in use`). The daemon binds the
socket itself instead and passes it down (`subprocess.Popen(pass_fds=...)`, `serve --fd N`): the
address is held from the moment it is known, so the endpoint URL is right before the child starts.
"""

from __future__ import annotations

import socket


class NoFreePort(OSError):
    """Every port of the configured range is taken."""


def bind_replica_socket(host: str, port_range: tuple[int, int] | None = None) -> socket.socket:
    """A TCP socket bound to `host`, not yet listening (the child listens once it serves, so a poll
    before that is refused at once instead of waiting in the backlog).

    Without a range the OS picks a free port (port 0). With one, the first port whose bind succeeds:
    a port taken by anything else moves on to the next. No SO_REUSEADDR: with it, Linux lets two
    sockets that both set it bind one port as long as neither listens yet, which two replicas
    starting together would.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = [0] if port_range is None else range(port_range[0], port_range[1] + 1)
    last_error: OSError | None = None
    for port in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            last_error = exc
            continue
        return sock
    if port_range is None:
        raise last_error
    raise NoFreePort(
        f"no free port in {port_range[0]}-{port_range[1]} for the replica (the last bind said: {last_error})"
    )
