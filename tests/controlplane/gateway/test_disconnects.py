"""Clients that leave before their answer, through the running gateway and replicas: the
generation is aborted on the replica, the client's concurrency slot is freed, and the request is
billed by one rule for streams and whole answers (cancelled once the replica generated a first
token, released unbilled before); a cancelled request's record keeps the prompt tokens it used,
and of those the ones read from the prefix cache, whichever API it came through.

A replica that must not produce a token is stopped (SIGSTOP): the kernel still accepts the
gateway's connection and request, so the request is at the replica, waiting, with certainty."""

import json
import logging
import signal
import socket
import time
from contextlib import contextmanager
from decimal import Decimal
from urllib.parse import urlsplit

import httpx
import pytest

from controlplane.billing.models import CreditEntry, CreditHold, UsageRecord
from controlplane.billing.selectors import credit_balance
from tests.controlplane.gateway.conftest import WORKER_TOKEN, ReplicaServer, make_world, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

logger = logging.getLogger(__name__)

CHAT = [{"role": "user", "content": "hi"}]
PRICE = Decimal("0.002")
MAX_TOKENS = 240  # as long as the replicas' 256-token context allows after a 2-token prompt


def _open_request(world, path: str, body: dict) -> socket.socket:
    """Send a request with a plain socket and read nothing: closing it is the client leaving."""
    url = urlsplit(world.base_url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(
        (
            f"POST {path} HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {world.api_key.plaintext}\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode()
        + payload
    )
    return sock


def _held(world) -> bool:
    return CreditHold.objects.filter(tenant=world.tenant).exists()


@contextmanager
def _stopped(replica: ReplicaServer):
    replica.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        replica.process.send_signal(signal.SIGCONT)


def _replica_figures(replica: ReplicaServer) -> tuple[dict, int]:
    """The replica's /stats, and how many requests it completed (its end-to-end latency count)."""
    headers = {"Authorization": f"Bearer {WORKER_TOKEN}"}
    stats = httpx.get(f"{replica.url}/stats", headers=headers, timeout=10).json()
    metrics = httpx.get(f"{replica.url}/metrics", headers=headers, timeout=10).text
    completed = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:e2e_request_latency_seconds_count")
    )
    return stats, int(completed)


def _slot_is_free(world) -> None:
    """The key allows one request at a time: the next one is served, not refused with 429."""
    world.client().chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=1)


def _keeps_its_prompt_tokens(world) -> None:
    """The cancelled request's record counts the prompt tokens it used, as a completed one does."""
    prompt_tokens = (
        world.client().completions.create(model=world.model.public_name, prompt="go", max_tokens=1).usage.prompt_tokens
    )
    cancelled = UsageRecord.objects.get(tenant=world.tenant, status="cancelled")
    assert cancelled.prompt_tokens == prompt_tokens > 0


def _unbilled(world) -> None:
    assert not UsageRecord.objects.filter(tenant=world.tenant).exists()
    assert not CreditEntry.objects.filter(tenant=world.tenant, kind="usage").exists()
    assert credit_balance(tenant=world.tenant) == Decimal("10")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_gone_before_the_first_token_is_released_unbilled(gateway, replicas, stream):
    world = make_world(gateway, replicas[:1], max_concurrent_requests=1)
    with _stopped(replicas[0]):
        sock = _open_request(
            world,
            "/v1/chat/completions",
            {"model": world.model.public_name, "messages": CHAT, "max_tokens": 5, "stream": stream},
        )
        wait_until(lambda: _held(world), 15, "the request to be admitted and held")
        sock.close()
        # Released while the replica is still stopped: the gateway did not wait for a token.
        wait_until(lambda: not _held(world), 15, "the hold to be released")
    _unbilled(world)
    _slot_is_free(world)
    world.settled()
    assert list(UsageRecord.objects.values_list("status", flat=True)) == ["completed"]  # only the last one


def test_a_stream_left_after_its_first_token_is_billed_cancelled_once(gateway, replicas):
    world = make_world(gateway, replicas[:1], max_concurrent_requests=1)
    stream = world.client().completions.create(
        model=world.model.public_name, prompt="go", max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    world.settled()
    assert list(UsageRecord.objects.values_list("status", "price_charged")) == [("cancelled", PRICE)]
    assert credit_balance(tenant=world.tenant) == Decimal("10") - PRICE
    _slot_is_free(world)
    _keeps_its_prompt_tokens(world)


def test_a_stream_left_after_its_first_token_keeps_its_cached_prompt_tokens(gateway, replicas):
    world = make_world(gateway, replicas[:1], max_concurrent_requests=1)
    prompt = "the same prompt again " * 6
    # The first request leaves the prompt in the replica's prefix cache; the second reads it from there.
    world.client().completions.create(model=world.model.public_name, prompt=prompt, max_tokens=1)
    stream = world.client().completions.create(
        model=world.model.public_name, prompt=prompt, max_tokens=64, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    world.settled()
    cancelled = UsageRecord.objects.get(tenant=world.tenant, status="cancelled")
    assert 0 < cancelled.cached_prompt_tokens < cancelled.prompt_tokens


# A whole answer in each API's shape (and its name for max_tokens), for a prompt of several KV
# blocks; greedy where the API has no ignore_eos, so the tiny model's answer runs to its limit.
CACHED_PROMPT = "the same prompt again " * 3
WHOLE_ANSWERS = {
    "/v1/completions": ({"prompt": CACHED_PROMPT, "ignore_eos": True}, "max_tokens"),
    "/v1/messages": ({"messages": [{"role": "user", "content": CACHED_PROMPT}], "temperature": 0}, "max_tokens"),
    "/v1/responses": ({"input": CACHED_PROMPT, "temperature": 0}, "max_output_tokens"),
}


def _whole_answer(world, path: str, max_tokens: int) -> dict:
    body, max_tokens_field = WHOLE_ANSWERS[path]
    return {"model": world.model.public_name, **body, max_tokens_field: max_tokens}


@pytest.mark.parametrize("path", list(WHOLE_ANSWERS))
def test_a_whole_answer_left_mid_generation_keeps_its_cached_prompt_tokens(gateway, replicas, path):
    """As a stream left after its first token does: the replica's answer to the gateway's
    question (did it start?) carries the cached count, in every API that ends in a chat."""
    world = make_world(gateway, replicas[:1], max_concurrent_requests=1)
    replica = replicas[0]
    # The first request leaves the prompt in the replica's prefix cache; the second reads it from there.
    warm = httpx.post(
        f"{world.base_url}{path}",
        json=_whole_answer(world, path, 1),
        headers={"authorization": f"Bearer {world.api_key.plaintext}"},
        timeout=60,
    )
    assert warm.status_code == 200, warm.text
    before, _ = _replica_figures(replica)
    sock = _open_request(world, path, _whole_answer(world, path, 150))
    wait_until(
        lambda: _replica_figures(replica)[0]["num_generated_tokens"] >= before["num_generated_tokens"] + 2,
        30,
        "the replica to generate the first tokens",
    )
    sock.close()
    world.settled()
    cancelled = UsageRecord.objects.get(tenant=world.tenant, status="cancelled")
    completed = UsageRecord.objects.get(tenant=world.tenant, status="completed")
    assert cancelled.prompt_tokens == completed.prompt_tokens
    assert 0 < cancelled.cached_prompt_tokens < cancelled.prompt_tokens


def test_a_whole_answer_left_mid_generation_is_aborted_on_the_replica_and_billed_cancelled(gateway, replicas):
    world = make_world(gateway, replicas[:1], max_concurrent_requests=1)
    replica = replicas[0]
    before, completed_before = _replica_figures(replica)
    sock = _open_request(
        world,
        "/v1/completions",
        {"model": world.model.public_name, "prompt": "go", "max_tokens": MAX_TOKENS, "ignore_eos": True},
    )
    # The replica is generating this request's tokens (it is the only one it serves now).
    wait_until(
        lambda: _replica_figures(replica)[0]["num_generated_tokens"] >= before["num_generated_tokens"] + 2,
        30,
        "the replica to generate the first tokens",
    )
    sock.close()
    left = time.monotonic()
    wait_until(lambda: _replica_figures(replica)[0]["in_flight"] == 0, 30, "the replica to end the request")
    # Measured, not asserted (the target is 1 s): from the client leaving to the replica
    # having aborted the generation and answered its (gone) caller.
    logger.warning(
        "a non-streaming disconnect was aborted on the replica %.3f s after the client left", time.monotonic() - left
    )
    after, completed_after = _replica_figures(replica)
    assert completed_after == completed_before  # aborted, not run to max_tokens
    assert after["running"] == 0 and after["kv_cache_usage"] == 0.0
    assert after["num_generated_tokens"] - before["num_generated_tokens"] < MAX_TOKENS
    world.settled()
    assert list(UsageRecord.objects.values_list("status", "price_charged")) == [("cancelled", PRICE)]
    assert credit_balance(tenant=world.tenant) == Decimal("10") - PRICE
    _slot_is_free(world)
    _keeps_its_prompt_tokens(world)
