"""A replica that fails mid-answer, as the client and the operator see it: the client gets a generic
error naming its request id (a 503 before anything was sent, an error event ending a stream that
had started), never the gateway's internals (IncompleteReadError, the replica's own words); the
detail goes to the gateway's log; nothing is charged.

The replica is outside the gateway under test, so a small HTTP server stands in for it, failing
as each test tells it to."""

from __future__ import annotations

import json
import socketserver
import threading
from decimal import Decimal

import httpx
import openai
import pytest

from controlplane.billing.models import UsageRecord
from controlplane.billing.selectors import credit_balance
from tests.controlplane.gateway.conftest import answer_one_request, make_world, start_module_gateway

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "hi"}]
# Words of the gateway's or the replica's internals that a client must never read.
INTERNALS = ("IncompleteRead", "broke off", "Traceback", "CUDA", "bearer token", "not-http", "<html>", "127.0.0.1")


def _chunk(content: str | None, role: bool = False) -> bytes:
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    event = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST_TOKEN = _chunked(_chunk(None, role=True) + _chunk("Hel"))
ENGINE_ERROR = {
    "error": {
        "message": "the engine failed: RuntimeError: CUDA error: an illegal memory access",
        "type": "server_error",
        "param": None,
        "code": None,
    }
}


def _json_head(status: str, length: int) -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n".encode()


def _whole(status: str, body: bytes) -> bytes:
    return _json_head(status, len(body)) + body


# What the stand-in replica sends for each way of failing (and then it closes the connection).
FAILURES = {
    # Whole answers (and streams before their first token).
    "drops the connection mid-answer": _json_head("200 OK", 500) + b'{"id": "chatcmpl-fake", "choi',
    "answers something that is not HTTP": b"not-http garbage\r\n\r\n",
    "answers 200 with a body that is not JSON": _whole("200 OK", b"<html>oops</html>"),
    "answers 400 that is not an OpenAI error": _whole("400 Bad Request", b"Bad Request"),
    "refuses the gateway's token (401)": _whole(
        "401 Unauthorized",
        json.dumps(
            {
                "error": {
                    "message": "missing or wrong bearer token",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode(),
    ),
    "drops a stream before its first token": STREAM_HEAD + _chunked(_chunk(None, role=True)),
    # Streams after their first token.
    "drops a stream mid-answer": STREAM_HEAD + FIRST_TOKEN,
    "sends a chunk size that is not one": STREAM_HEAD + FIRST_TOKEN + b"zz\r\n",
    "sends an event that is not a chunk": STREAM_HEAD + FIRST_TOKEN + _chunked(b"data: <html>\n\n"),
    "sends its own error event": STREAM_HEAD
    + FIRST_TOKEN
    + _chunked(b"data: " + json.dumps(ENGINE_ERROR).encode() + b"\n\n")
    + _chunked(b"data: [DONE]\n\n")
    + b"0\r\n\r\n",
}
# What the gateway's log says of each (the detail the client is spared).
LOGGED = {
    "drops the connection mid-answer": "IncompleteReadError",
    "answers something that is not HTTP": "not an HTTP/1.x status line",
    "answers 200 with a body that is not JSON": "<html>oops</html>",
    "answers 400 that is not an OpenAI error": "Bad Request",
    "refuses the gateway's token (401)": "answered 401",
    "drops a stream before its first token": "IncompleteReadError",
    "drops a stream mid-answer": "IncompleteReadError",
    "sends a chunk size that is not one": "invalid literal for int() with base 16",
    "sends an event that is not a chunk": "<html>",
    "sends its own error event": "CUDA error: an illegal memory access",
}


class StandInReplica(socketserver.ThreadingTCPServer):
    """Answers every request with `self.failure`'s bytes, then drops the connection."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.failure = ""
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        answer_one_request(self.request, FAILURES[self.server.failure])


@pytest.fixture(scope="module")
def stand_in():
    server = StandInReplica()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def logged_gateway(database_url, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("gateway-log") / "gateway.log"
    with open(log_path, "wb") as log:
        server = start_module_gateway(database_url, log=log)
    server.log_path = log_path
    yield server
    server.stop()


def _assert_generic(message: str, request_id: str, log_path, failure: str) -> None:
    assert request_id in message
    assert not [word for word in INTERNALS if word in message], message
    log = log_path.read_text()
    assert any(request_id in line and LOGGED[failure] in line for line in log.splitlines()), log[-3000:]


def _assert_not_charged(world) -> None:
    world.settled()
    record = UsageRecord.objects.get(tenant=world.tenant)
    assert (record.status, record.price_charged) == ("failed", Decimal("0"))
    assert credit_balance(tenant=world.tenant) == Decimal("10")


@pytest.mark.parametrize("failure", list(FAILURES)[:5])
def test_a_whole_answer_that_fails_is_a_503_naming_the_request_only(logged_gateway, stand_in, failure):
    stand_in.failure = failure
    world = make_world(logged_gateway, [stand_in])
    with pytest.raises(openai.InternalServerError) as error:
        world.client().chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=4)
    assert error.value.status_code == 503 and error.value.code == "replica_unavailable"
    assert error.value.body["type"] == "service_unavailable"
    _assert_generic(error.value.message, error.value.response.headers["x-request-id"], logged_gateway.log_path, failure)
    _assert_not_charged(world)


def test_a_stream_that_fails_before_its_first_token_is_a_503_naming_the_request_only(logged_gateway, stand_in):
    stand_in.failure = failure = "drops a stream before its first token"
    world = make_world(logged_gateway, [stand_in])
    with pytest.raises(openai.InternalServerError) as error:
        world.client().chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=4, stream=True)
    assert error.value.status_code == 503 and error.value.code == "replica_unavailable"
    _assert_generic(error.value.message, error.value.response.headers["x-request-id"], logged_gateway.log_path, failure)
    _assert_not_charged(world)


@pytest.mark.parametrize("failure", list(FAILURES)[6:])
def test_a_stream_that_fails_after_its_first_token_ends_with_a_generic_error_event(logged_gateway, stand_in, failure):
    stand_in.failure = failure
    world = make_world(logged_gateway, [stand_in])
    with httpx.stream(
        "POST",
        f"{world.base_url}/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {world.api_key.plaintext}"},
        json={"model": world.model.public_name, "messages": CHAT, "stream": True},
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}, {"content": "Hel"}]
    assert len(chunks) == 3, events  # the tokens so far, then the error: no [DONE] after it
    error = chunks[2]["error"]
    assert (error["type"], error["code"], error["param"]) == ("server_error", "replica_failed", None)
    _assert_generic(error["message"], request_id, logged_gateway.log_path, failure)
    _assert_not_charged(world)
