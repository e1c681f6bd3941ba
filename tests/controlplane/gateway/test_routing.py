"""Routing through the running gateway: least outstanding requests with prefix affinity, one
retry on another replica before the first token, and a replica killed mid-run."""

import threading
import time
from collections import Counter
from decimal import Decimal
from types import SimpleNamespace

import openai
import pytest
import redis

from controlplane.billing.models import UsageRecord
from controlplane.billing.selectors import credit_balance
from controlplane.gateway.replica_choice import affinity_choice, affinity_key
from tests.controlplane.gateway.conftest import (
    AFFINITY_PREFIX_CHARS,
    ReplicaServer,
    free_port,
    make_world,
    start_replica,
    wait_ready,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SHORT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def spare_replica(checkpoint):
    """A third replica server, to be killed; it loads while the module's first tests run."""
    server = start_replica(checkpoint, "tiny")
    yield server
    server.kill()


@pytest.fixture(autouse=True)
def _start_loading_the_spare_early(spare_replica):
    pass


def _dead(url_port=None) -> ReplicaServer:
    """A replica endpoint nothing listens on."""
    return ReplicaServer(f"http://127.0.0.1:{url_port or free_port()}", process=None)


def _served_by(request_id: str) -> int:
    wait_until(lambda: UsageRecord.objects.filter(request_id=request_id).exists(), 10, f"{request_id}'s record")
    return UsageRecord.objects.get(request_id=request_id).replica_id


def _ask(world, messages=SHORT, **kwargs) -> str:
    response = world.client().chat.completions.with_raw_response.create(
        model=world.model.public_name, messages=messages, max_tokens=1, **kwargs
    )
    return response.headers["x-request-id"]


def _busy(gateway, replica_id: int, count: int) -> None:
    """Make `count` requests look in flight on the replica to every gateway process."""
    shared = redis.Redis.from_url(gateway.redis_url)
    deadline_ms = (time.time() + 600) * 1000
    shared.zadd(f"gw:outstanding:{replica_id}", {f"busy-{replica_id}-{i}": deadline_ms for i in range(count)})


def test_least_outstanding_requests(gateway, replicas):
    world = make_world(gateway, replicas)
    first, second = (r.pk for r in world.replicas)
    _busy(gateway, first, 2)
    assert _served_by(_ask(world)) == second
    _busy(gateway, second, 3)
    assert _served_by(_ask(world)) == first


def test_a_conversation_sticks_to_one_replica_while_conversations_behind_one_system_prompt_spread(gateway, replicas):
    world = make_world(gateway, replicas)
    system = {"role": "system", "content": "You are a careful assistant. " * 3}
    assert len(system["content"]) > AFFINITY_PREFIX_CHARS  # the old rule pinned every conversation here

    def home_of(question: str) -> int:  # where the router's rule sends this conversation
        ids = [SimpleNamespace(replica_id=r.pk) for r in world.replicas]
        key = affinity_key({"messages": [system, {"role": "user", "content": question}]}, True, AFFINITY_PREFIX_CHARS)
        return ids[affinity_choice(key, ids)].replica_id

    questions = [f"question {i}?" for i in range(64)]
    # Two conversations whose openings hash to different replicas: they go there, not both to one.
    first, second = (next(q for q in questions if home_of(q) == r.pk) for r in world.replicas)
    assert _served_by(_ask(world, [system, {"role": "user", "content": first}])) == home_of(first)
    assert _served_by(_ask(world, [system, {"role": "user", "content": second}])) == home_of(second)
    # One conversation's later turns resend its history: they stay on its replica.
    home = home_of(first)
    history = [system, {"role": "user", "content": first}]
    for turn in range(3):
        history += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"and {turn}?"}]
        assert _served_by(_ask(world, history)) == home
    _busy(gateway, home, 4)  # four more than the other replica: still within the allowance
    assert _served_by(_ask(world, history)) == home
    _busy(gateway, home, 5)
    (other,) = {r.pk for r in world.replicas} - {home}
    assert _served_by(_ask(world, history)) == other


def test_a_replica_failing_before_the_first_token_is_retried_on_another(gateway, replicas):
    world = make_world(gateway, [_dead(), replicas[0]])
    dead, alive = (r.pk for r in world.replicas)
    shared = redis.Redis.from_url(gateway.redis_url)
    for stream in (False, True, False):
        request_id = _ask(world, stream=stream) if not stream else None
        if stream:
            with world.client().chat.completions.with_streaming_response.create(
                model=world.model.public_name, messages=SHORT, max_tokens=2, stream=True
            ) as response:
                request_id = response.headers["x-request-id"]
                assert list(response.parse())
        assert _served_by(request_id) == alive
    assert shared.exists(f"gw:down:{dead}")  # passed over by every gateway process for a while


def test_when_every_replica_fails_the_request_is_503_and_free(gateway, replicas):
    world = make_world(gateway, [_dead(), _dead()])
    with pytest.raises(openai.InternalServerError) as error:
        world.client().chat.completions.create(model=world.model.public_name, messages=SHORT, max_tokens=1)
    assert error.value.status_code == 503 and error.value.code == "replica_unavailable"
    assert "retry-after" in error.value.response.headers
    world.settled()
    record = UsageRecord.objects.get()
    assert (record.status, record.price_charged) == ("failed", Decimal("0"))
    assert record.error_code == "replica_unavailable"  # what the client was told, for the request log
    assert credit_balance(tenant=world.tenant) == Decimal("10")


def test_killing_a_replica_mid_run_sends_the_next_requests_to_the_other(gateway, replicas, spare_replica):
    wait_ready(spare_replica)
    world = make_world(gateway, [replicas[0], spare_replica])
    survivor, victim = (r.pk for r in world.replicas)
    results: list[tuple[float, str]] = []  # (finished at, request id or error)
    stop = threading.Event()

    def client_loop():
        client = world.client()
        while not stop.is_set():
            try:
                response = client.chat.completions.with_raw_response.create(
                    model=world.model.public_name, messages=SHORT, max_tokens=8, extra_body={"ignore_eos": True}
                )
                results.append((time.monotonic(), response.headers["x-request-id"]))
            except openai.APIError as error:
                results.append((time.monotonic(), f"error: {error!r}"))

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while UsageRecord.objects.filter(replica_id=victim).count() < 3:  # both replicas are serving
            assert time.monotonic() < deadline, "the second replica never got traffic"
            time.sleep(0.05)
        spare_replica.kill()  # SIGKILL, with requests in flight on it
        killed_at = time.monotonic()
        time.sleep(2.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    errors = [outcome for _, outcome in results if outcome.startswith("error")]
    assert not errors, errors  # in-flight requests on the killed replica were retried on the other
    after = [request_id for finished, request_id in results if finished > killed_at + 0.5]
    assert len(after) >= 4
    assert Counter(_served_by(request_id) for request_id in after) == {survivor: len(after)}
