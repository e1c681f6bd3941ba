"""The daemon -> spare hand-over message: a load arrives whole with its two descriptors; a closed
daemon end means no load; a malformed message is refused without leaking the descriptors."""

from __future__ import annotations

import os
import socket

import pytest

from gpuworker.contract.spare_handover import receive_load, send_load


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield ours, theirs
    ours.close()
    theirs.close()


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def test_a_load_arrives_with_the_listener_and_the_log(pair, tmp_path):
    ours, theirs = pair
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    address = listener.getsockname()
    with listener, open(tmp_path / "replica.log", "ab") as log:
        send_load(ours, ["--model", "/m", "--device", "cpu"], listener.fileno(), log.fileno())
    argv, listener_fd, log_fd = receive_load(theirs)
    assert argv == ["--model", "/m", "--device", "cpu"]
    received = socket.socket(fileno=listener_fd)  # the same bound socket, though ours is closed
    assert received.getsockname() == address
    received.close()
    os.write(log_fd, b"written by the spare\n")
    os.close(log_fd)
    assert (tmp_path / "replica.log").read_text() == "written by the spare\n"


def test_a_closed_daemon_end_means_no_load(pair):
    ours, theirs = pair
    ours.close()
    assert receive_load(theirs) is None


def test_a_malformed_load_is_refused_and_its_descriptors_closed(pair, tmp_path):
    ours, theirs = pair
    with open(tmp_path / "f", "wb") as f:
        socket.send_fds(ours, [b'{"not": "a list"}'], [f.fileno(), f.fileno()])
        socket.send_fds(ours, [b'["--model", "/m"]'], [f.fileno()])
    before = _open_fds()
    with pytest.raises(ValueError, match="must be a list of strings"):
        receive_load(theirs)
    with pytest.raises(ValueError, match="expects 2 file descriptors"):
        receive_load(theirs)
    assert _open_fds() == before
