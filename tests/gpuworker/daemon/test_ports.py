"""Replica sockets bound by the daemon: any free port by default, or the first free one of a range."""

from __future__ import annotations

import socket

import pytest

from gpuworker.daemon.ports import NoFreePort, bind_replica_socket


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_by_default_the_os_chooses_a_free_port_and_nothing_listens_on_it_yet():
    first, second = bind_replica_socket("127.0.0.1"), bind_replica_socket("127.0.0.1")
    try:
        ports = {first.getsockname()[1], second.getsockname()[1]}
        assert len(ports) == 2 and 0 not in ports
        # Until the child serves, a health poll is refused at once rather than left in a backlog.
        assert all(_refused(port) for port in ports)
    finally:
        first.close()
        second.close()


def test_a_range_skips_ports_taken_by_listeners_and_by_sockets_only_bound():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    base = listener.getsockname()[1]
    if base > 65000:
        pytest.skip("the OS gave a port too near the top for a range")
    # A socket bound but not listening, with SO_REUSEADDR: Linux would let a second socket that also
    # set it share the port (two replicas starting together); ours does not set it, so it moves on.
    bound = socket.socket()
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        bound.bind(("127.0.0.1", base + 1))
    except OSError:
        pass  # taken by someone else already: taken all the same
    try:
        with bind_replica_socket("127.0.0.1", (base, base + 20)) as sock:
            port = sock.getsockname()[1]
            assert base + 2 <= port <= base + 20
            # The port stays ours until closed: the next replica gets another.
            with bind_replica_socket("127.0.0.1", (base, base + 20)) as other:
                assert other.getsockname()[1] not in (base, base + 1, port)
    finally:
        listener.close()
        bound.close()


def test_a_range_with_every_port_taken_says_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(NoFreePort, match=f"no free port in {port}-{port} for the replica"):
            bind_replica_socket("127.0.0.1", (port, port))
