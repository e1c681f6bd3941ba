"""Asking replicas whether they run: a real replica server answers; a closed port, a port that
never answers, a server that is not a replica (garbage) and a replica failed or draining (as one
does once its daemon is gone) are no evidence."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.fleet.replica_probe import any_replica_answers
from tests.controlplane.gateway.conftest import WORKER_TOKEN


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def answering(request):
    """An HTTP server that is not a replica, answering every GET with `request.param` (status, body)."""
    status, body = request.param

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_running_replica_answers(replica_server):
    assert any_replica_answers(endpoint_urls=[_closed_port_url(), replica_server.url], token=WORKER_TOKEN)


def test_a_running_replica_asked_with_the_wrong_token_is_no_evidence(replica_server):
    assert not any_replica_answers(endpoint_urls=[replica_server.url], token="not-the-fleet-token")


def test_a_closed_port_or_one_that_never_answers_is_no_evidence(silent_port):
    assert not any_replica_answers(endpoint_urls=[_closed_port_url(), silent_port], token=WORKER_TOKEN, timeout_s=0.2)


@pytest.mark.parametrize(
    "answering",
    [
        (200, b"not json"),
        (200, b'["ready"]'),
        (503, b'{"status": "failed"}'),
        (503, b'{"status": "draining"}'),
        (404, b'{"detail": "Not Found"}'),
    ],
    indirect=True,
)
def test_a_server_that_is_not_a_running_replica_is_no_evidence(answering):
    assert not any_replica_answers(endpoint_urls=[answering], token=WORKER_TOKEN)
