"""What the gateway does with a request body before anything else: a byte limit (with and without
Content-Length), and a 400 for whatever cannot be parsed, never a 500; bad input never benches a
replica."""

import json

import httpx
import pytest
import redis
from django.conf import settings

from controlplane.billing.models import UsageRecord
from tests.controlplane.gateway.conftest import make_world, raw_connection, read_raw_response

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PATHS = ["/v1/chat/completions", "/v1/completions"]


@pytest.fixture
def world(gateway, replicas):
    return make_world(gateway, replicas)


def _assert_too_large(status: int, headers: dict, body: bytes) -> None:
    limit = settings.GATEWAY_MAX_REQUEST_BYTES
    assert status == 413, body
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert str(limit) in error["message"]
    assert headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("path", PATHS)
def test_a_declared_length_over_the_limit_is_413_before_the_body_is_read(world, path):
    """The body is never sent: the answer comes from the Content-Length alone (and before the key)."""
    with raw_connection(world.base_url) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            f"content-length: {settings.GATEWAY_MAX_REQUEST_BYTES + 1}\r\n\r\n".encode()
        )
        _assert_too_large(*read_raw_response(sock))


@pytest.mark.parametrize("path", PATHS)
def test_a_chunked_body_over_the_limit_is_413_without_reading_the_rest(world, path):
    """No Content-Length: the gateway counts while reading and answers once past the limit, though
    the body never ends."""
    chunk = b"x" * 65536
    with raw_connection(world.base_url) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {world.api_key.plaintext}\r\n"
            "transfer-encoding: chunked\r\n\r\n".encode()
        )
        sent = 0
        while sent <= settings.GATEWAY_MAX_REQUEST_BYTES:
            sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sent += len(chunk)
        _assert_too_large(*read_raw_response(sock))  # and the terminating chunk is never sent
    assert not UsageRecord.objects.exists()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"[" * 100_000, None),
        (b'{"model": "m", "prompt": "\xff\xfe"}', None),
        (b"[1, 2]", None),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}], "prompt": "\\ud800"}',
            "messages.0.content",
        ),
    ],
)
def test_bodies_that_cannot_be_parsed_are_400(world, path, content, param):
    response = httpx.post(
        f"{world.base_url}{path}",
        content=content,
        timeout=60,
        headers={"authorization": f"Bearer {world.api_key.plaintext}", "content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def _replicas_passed_over(gateway, world) -> list[int]:
    """The replicas every gateway now passes over for having failed a request."""
    shared = redis.Redis.from_url(gateway.redis_url)
    return [row.pk for row in world.replicas if shared.exists(f"gw:down:{row.pk}")]


def test_bad_input_never_benches_a_replica(gateway, world):
    """20 poisoned requests: lone surrogates (refused by the gateway, as by the replica) and prompts
    beyond the context (refused by the replica: a 400 is the request's fault, not the replica's).
    Every replica stays routable and the next good request is served."""
    client = world.client()
    headers = {"authorization": f"Bearer {world.api_key.plaintext}", "content-type": "application/json"}
    model = world.model.public_name
    surrogate = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % model.encode()
    too_long = {"model": model, "prompt": "word " * 400, "max_tokens": 2}
    statuses = []
    for i in range(20):
        if i % 2:
            response = httpx.post(f"{world.base_url}/v1/chat/completions", content=surrogate, headers=headers)
        else:
            response = httpx.post(
                f"{world.base_url}/v1/completions", headers=headers, json={**too_long, "stream": i % 4 == 0}
            )
        statuses.append(response.status_code)
    assert statuses == [400] * 20
    assert _replicas_passed_over(gateway, world) == []
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].finish_reason is not None
    world.settled()
