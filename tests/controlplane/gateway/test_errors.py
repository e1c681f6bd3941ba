"""Every error of the public API, as the official SDK sees it: the exception class, the OpenAI
error body, the headers; and that none of them is billed."""

import threading
import time
from datetime import timedelta
from decimal import Decimal

import httpx
import openai
import pytest
import redis
from django.db import connections
from django.utils import timezone

from controlplane.accounts.services import api_key_revoke
from controlplane.billing.models import CreditEntry, UsageRecord
from controlplane.billing.selectors import credit_balance
from controlplane.fleet.models import Replica
from tests.controlplane.gateway.conftest import make_world

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def world(gateway, replicas):
    return make_world(gateway, replicas)


def _chat(world, client=None, **kwargs):
    client = client or world.client()
    return client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2, **kwargs)


def test_unknown_and_missing_keys_are_401(world):
    with pytest.raises(openai.AuthenticationError) as error:
        _chat(world, world.client(api_key="sk-not-a-key"))
    assert error.value.code == "invalid_api_key" and error.value.type == "invalid_request_error"
    missing = httpx.post(f"{world.base_url}/v1/chat/completions", json={"model": world.model.public_name})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"


def test_revoking_a_key_takes_effect_within_a_second(world):
    client = world.client()
    _chat(world, client)  # the gateway now has the key cached
    api_key_revoke(api_key=world.api_key)
    revoked_at = time.monotonic()
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError as error:
            assert "revoked" in error.message
            break
        assert time.monotonic() - revoked_at < 1.0, "the revoked key still worked after a second"
        time.sleep(0.02)


def test_expired_keys_are_401_even_when_cached(gateway, replicas):
    world = make_world(gateway, replicas, expires_at=timezone.now() + timedelta(seconds=2))
    client = world.client()
    _chat(world, client)
    time.sleep(max(0.0, (world.api_key.expires_at - timezone.now()).total_seconds()) + 0.05)
    with pytest.raises(openai.AuthenticationError, match="expired"):
        _chat(world, client)


def test_a_key_limited_to_other_models_gets_403(gateway, replicas):
    from tests.controlplane.factories import ModelFactory

    world = make_world(gateway, replicas, all_models=False)
    world.api_key.allowed_models.set([ModelFactory()])
    with pytest.raises(openai.PermissionDeniedError) as error:
        _chat(world)
    assert error.value.code == "model_not_allowed" and error.value.param == "model"
    assert world.model.public_name not in {m.id for m in world.client().models.list()}


def test_a_key_limited_to_this_model_may_use_it(gateway, replicas):
    world = make_world(gateway, replicas, all_models=False)
    world.api_key.allowed_models.set([world.model])
    assert _chat(world).choices


def test_unknown_model_is_404(world):
    with pytest.raises(openai.NotFoundError) as error:
        world.client().chat.completions.create(model="no-such-model", messages=CHAT)
    assert error.value.code == "model_not_found" and error.value.param == "model"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 2}, None),  # without logprobs: the request as a whole is wrong
        ({"messages": []}, "messages"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"the": -100}}, "logit_bias"),
        ({"n": 2, "extra_body": {"best_of": 4}}, "best_of"),
    ],
)
def test_bad_fields_are_400_naming_the_field(world, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        world.client().chat.completions.create(**{"model": world.model.public_name, "messages": CHAT, **fields})
    assert error.value.type == "invalid_request_error" and error.value.param == param
    assert not UsageRecord.objects.exists() and credit_balance(tenant=world.tenant) == Decimal("10")


def test_a_prompt_beyond_the_context_is_400_context_length_exceeded_and_free(world):
    with pytest.raises(openai.BadRequestError) as error:
        world.client().completions.create(model=world.model.public_name, prompt="word " * 400, max_tokens=2)
    assert error.value.code == "context_length_exceeded"
    assert error.value.response.headers["x-request-id"].startswith("req_")
    assert not UsageRecord.objects.exists() and not CreditEntry.objects.filter(kind="usage").exists()
    assert credit_balance(tenant=world.tenant) == Decimal("10")


def test_requests_per_minute_limit_is_429_with_headers(gateway, replicas):
    world = make_world(gateway, replicas, rate_limit_per_minute=2)
    client = world.client()
    first = client.chat.completions.with_raw_response.create(model=world.model.public_name, messages=CHAT, max_tokens=1)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    _chat(world, client)
    with pytest.raises(openai.RateLimitError) as error:
        _chat(world, client)
    headers = error.value.response.headers
    assert error.value.code == "rate_limit_exceeded"
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(headers["retry-after"]) <= 30 and headers["x-ratelimit-reset-requests"].endswith("s")
    world.settled()
    assert UsageRecord.objects.count() == 2


def test_plan_limit_applies_to_all_of_a_tenants_keys(gateway, replicas):
    from tests.controlplane.factories import ApiKeyFactory, PlanFactory

    world = make_world(gateway, replicas, plan=PlanFactory(rate_limit_per_minute=2))
    other_key = ApiKeyFactory(tenant=world.tenant)
    _chat(world)
    _chat(world, world.client(api_key=other_key.plaintext))
    with pytest.raises(openai.RateLimitError):
        _chat(world)


def test_concurrent_requests_limit_is_429(gateway, replicas):
    world = make_world(gateway, replicas, max_concurrent_requests=1)
    client = world.client()
    stream = client.chat.completions.create(
        model=world.model.public_name, messages=CHAT, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the first request is now in flight
    with pytest.raises(openai.RateLimitError) as error:
        _chat(world, client)
    assert error.value.code == "rate_limit_exceeded" and "concurrency" in error.value.message
    stream.close()  # the client goes away after its first token: charged as cancelled
    deadline = time.monotonic() + 5
    while True:
        try:
            _chat(world, client)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the first request's slot was never freed"
            time.sleep(0.05)
    world.settled()
    statuses = sorted(UsageRecord.objects.values_list("status", "price_charged"))
    assert statuses == [("cancelled", Decimal("0.002")), ("completed", Decimal("0.002"))]


def test_no_credit_is_429_insufficient_quota_not_retried(gateway, replicas):
    world = make_world(gateway, replicas, credit=Decimal("0"))
    client = world.client(max_retries=2)  # the SDK would retry a 429, but not this one
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as error:
        _chat(world, client)
    assert error.value.code == "insufficient_quota" and error.value.type == "insufficient_quota"
    assert error.value.response.headers["x-should-retry"] == "false"
    assert time.monotonic() - started < 0.5  # no back-off happened
    assert not UsageRecord.objects.exists()
    # Refused at its credit hold after it was routed: its place on the replica is freed, so it
    # neither counts as in flight there nor as queued work the next request's wait is predicted from.
    shared = redis.Redis.from_url(gateway.redis_url)
    for replica in world.replicas:
        for key in (f"gw:outstanding:{replica.pk}", f"gw:routed:{replica.pk}"):
            assert shared.zcard(key) == 0, key


def test_no_ready_replica_is_503_with_retry_after(gateway, replicas):
    world = make_world(gateway, replicas)
    Replica.objects.filter(pk__in=[r.pk for r in world.replicas]).update(state=Replica.State.DRAINING)
    time.sleep(0.2)  # the gateway re-reads the routing table every 100 ms here
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as error:
        _chat(world)
    assert error.value.status_code == 503 and error.value.response.headers["retry-after"] == "3"
    assert time.monotonic() - started < 1.0  # nothing is loading: no reason to wait
    assert not UsageRecord.objects.exists() and credit_balance(tenant=world.tenant) == Decimal("10")


def test_a_loading_replica_is_waited_for_then_503(gateway, replicas):
    world = make_world(gateway, replicas)
    Replica.objects.filter(pk__in=[r.pk for r in world.replicas]).update(state=Replica.State.LOADING)
    time.sleep(0.2)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as error:
        _chat(world)
    waited = time.monotonic() - started
    assert error.value.status_code == 503 and error.value.code == "cold_start_timeout"
    assert 1.8 <= waited < 4.0  # GATEWAY_COLD_START_WAIT_SECONDS is 2 here


def test_a_request_waiting_for_a_loading_replica_is_served_once_it_is_ready(gateway, replicas):
    world = make_world(gateway, replicas)
    Replica.objects.filter(pk__in=[r.pk for r in world.replicas]).update(state=Replica.State.LOADING)
    time.sleep(0.2)

    def make_ready():
        Replica.objects.filter(pk=world.replicas[0].pk).update(state=Replica.State.READY)
        connections.close_all()  # this thread's own connection

    ready = threading.Timer(0.7, make_ready)
    ready.start()
    try:
        assert _chat(world).choices
    finally:
        ready.join()


@pytest.mark.parametrize(("fields", "param"), [({"max_tokens": "4"}, "max_tokens"), ({"stream": "yes"}, "stream")])
def test_fields_of_the_wrong_type_are_400_naming_the_field(world, fields, param):
    response = httpx.post(
        f"{world.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {world.api_key.plaintext}"},
        json={"model": world.model.public_name, "messages": CHAT, **fields},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert not UsageRecord.objects.exists()


def test_the_bearer_scheme_is_case_insensitive(world):
    for scheme in ("bearer", "BEARER"):
        response = httpx.get(
            f"{world.base_url}/v1/models", headers={"Authorization": f"{scheme} {world.api_key.plaintext}"}
        )
        assert response.status_code == 200 and world.model.public_name in {m["id"] for m in response.json()["data"]}
    assert (
        httpx.get(
            f"{world.base_url}/v1/models", headers={"Authorization": f"Basic {world.api_key.plaintext}"}
        ).status_code
        == 401
    )
