"""Every refused request is visible: each refusal made through the openai SDK (a bad key, a bad
body, an unknown model, a body too large, a rate limit, no credit, a shed request) is found in the
tenant's request log, in the operator's error figure and in /metrics, and none is charged. Shedding:
a replica whose load report predicts a wait over the deployment's TTFT objective gets no request;
the client gets a 429 (529 in Anthropic's dialect) with Retry-After at once."""

import asyncio
import math
import os
import threading
import time
from datetime import UTC, datetime
from decimal import Decimal

import httpx
import openai
import pytest
import redis
from django.db.models import Sum
from django.test import Client
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from controlplane.accounts.models import User
from controlplane.billing.models import CreditAccount, CreditHold, Refusal, UsageRecord
from controlplane.fleet import heartbeat_cache
from controlplane.gateway.database import DatabaseLane
from controlplane.gateway.refusals import RefusalLog
from tests.controlplane.factories import ApiKeyFactory, DeploymentFactory, ModelFactory, TenantFactory, UserFactory
from tests.controlplane.gateway.conftest import make_world, start_gateway, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "Refuse me."}]
TOKEN = "refusals-test-token"
MAX_BYTES = 65536
MAX_FILE_BYTES = 1024
PRICE = Decimal("0.002")


@pytest.fixture
def refusal_gateway(gateway, database_url):
    """A gateway on this process's Redis database (so that the load reports written here are the
    ones it reads), writing its refusal tallies every 0.2 s, with a small body limit."""
    redis_url = os.environ["REDIS_URL"]
    redis.Redis.from_url(redis_url).flushdb()
    server = start_gateway(
        database_url,
        redis_url,
        METRICS_TOKEN=TOKEN,
        GATEWAY_REFUSAL_FLUSH_SECONDS="0.2",
        GATEWAY_MAX_REQUEST_BYTES=str(MAX_BYTES),
        BATCH_MAX_FILE_BYTES=str(MAX_FILE_BYTES),
    )
    yield server
    server.stop()


def _requests_counted(url: str, by: tuple[str, ...] = ("outcome", "status")) -> dict[tuple[str, ...], float]:
    """/metrics' request counter by the labels `by`, summed over the others."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    counts: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpuserve_gateway_requests_total":
                key = tuple(sample.labels[label] for label in by)
                counts[key] = counts.get(key, 0) + sample.value
    return counts


def _refused(error_type, call) -> tuple[int, str, str]:
    """(status, error code (else type), request id) of a call the gateway refuses with `error_type`."""
    with pytest.raises(error_type) as refused:
        call()
    response = refused.value.response
    error = response.json()["error"]
    return response.status_code, error["code"] or error["type"], response.headers["x-request-id"]


def _report_load(world, waiting_tokens: int, prefill_tokens_per_s: float) -> float:
    """The world's worker's heartbeat as the control plane stores it, with each replica's load;
    returns when it was received."""
    worker_id = world.replicas[0].worker_id
    figures = {"waiting_tokens": waiting_tokens, "prefill_tokens_per_s": prefill_tokens_per_s}
    received_at = time.time()
    replicas = {str(r.pk): figures for r in world.replicas}
    heartbeat_cache.store(worker_id=worker_id, state={"received_at": received_at, "replicas": replicas})
    return received_at


def _drained_retry_after(value: str, reported_s: int, report_at: float) -> bool:
    """Whether a shed's retry-after is `reported_s` (the reported queue's drain back under the
    objective, counted from the report) less the time since the report, which the replica spent
    prefilling that queue: all a test can bound it by."""
    since_report_s = time.time() - report_at
    return max(1, math.ceil(reported_s - since_report_s)) <= int(value) <= reported_s


def _shed(world, client) -> tuple[tuple[int, str, str], httpx.Headers, int]:
    """Requests until one is shed (the gateway's routing table has read the load report): that
    one's figures and headers, and how many were served before it."""
    found = {"served": 0}

    def shed() -> bool:
        try:
            client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=1)
        except openai.RateLimitError as error:
            found["error"] = error
            return error.code == "overloaded"
        found["served"] += 1
        return False

    wait_until(shed, 20, "the gateway to shed by the load report")
    response = found["error"].response
    return (429, "overloaded", response.headers["x-request-id"]), response.headers, found["served"]


def test_every_refusal_is_in_the_tenant_log_the_operator_figure_and_metrics(refusal_gateway, replicas):
    world = make_world(refusal_gateway, replicas, price=PRICE)
    world.model.deployment.ttft_slo_ms = 2000
    world.model.deployment.save()
    client, name = world.client(), world.model.public_name
    # A model with no replica and none allowed to start: its requests fail at once (503).
    stopped = ModelFactory(price_tier=world.model.price_tier)
    DeploymentFactory(model=stopped, desired_replicas=0, max_replicas=0)
    limited = ApiKeyFactory(tenant=world.tenant, rate_limit_per_minute=1)
    world.client(limited.plaintext).chat.completions.create(model=name, messages=CHAT, max_tokens=1)  # served
    before = _requests_counted(refusal_gateway.url)

    tenant_refusals = [
        _refused(
            openai.BadRequestError, lambda: client.chat.completions.create(model=name, messages=CHAT, max_tokens=0)
        ),
        _refused(openai.NotFoundError, lambda: client.chat.completions.create(model="no-such-model", messages=CHAT)),
        _refused(
            openai.APIStatusError,
            lambda: client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "x" * MAX_BYTES}], max_tokens=1
            ),
        ),
        _refused(
            openai.RateLimitError,
            lambda: world.client(limited.plaintext).chat.completions.create(model=name, messages=CHAT, max_tokens=1),
        ),
        _refused(
            openai.InternalServerError,
            lambda: client.chat.completions.create(model=stopped.public_name, messages=CHAT, max_tokens=1),
        ),
    ]
    report_at = _report_load(world, waiting_tokens=20_000, prefill_tokens_per_s=1000.0)  # 20 s of queue
    shed, headers, served = _shed(world, client)
    served += 1  # and the limited key's first
    # The queue's drain back under the 2 s objective: 18 s from the report, less the time since.
    assert _drained_retry_after(headers["retry-after"], 18, report_at)
    tenant_refusals.append(shed)
    _report_load(world, waiting_tokens=0, prefill_tokens_per_s=1000.0)
    anonymous = _refused(
        openai.AuthenticationError,
        lambda: world.client("sk-not-a-key").chat.completions.create(model=name, messages=CHAT),
    )
    broke = make_world(refusal_gateway, replicas, credit=Decimal("0"), price=PRICE)
    no_credit = _refused(
        openai.RateLimitError,
        lambda: broke.client().chat.completions.create(model=broke.model.public_name, messages=CHAT, max_tokens=1),
    )
    assert [status for status, _, _ in tenant_refusals] == [400, 404, 413, 429, 503, 429]
    assert [anonymous[:2], no_credit[:2]] == [(401, "invalid_api_key"), (429, "insufficient_quota")]

    every = [*tenant_refusals, anonymous, no_credit]
    wait_until(
        lambda: Refusal.objects.filter(request_id__in=[r for _, _, r in every]).count() == len(every),
        20,
        "the refusals to be written",
    )
    for status, code, request_id in tenant_refusals:
        row = Refusal.objects.get(request_id=request_id)
        assert (row.tenant_id, row.status, row.error_code, row.count) == (world.tenant.pk, status, code, 1)
    assert Refusal.objects.get(request_id=anonymous[2]).tenant_id is None
    assert Refusal.objects.get(request_id=no_credit[2]).tenant_id == broke.tenant.pk

    # The tenant's log shows its own refusals, filterable; not another tenant's, nor the bad key's.
    member = Client()
    member.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=world.tenant))
    page = member.get(reverse("dashboard:requests")).content.decode()
    for _, code, request_id in tenant_refusals:
        assert f'data-request-id="{request_id}"' in page and f'data-code="{code}"' in page
    assert anonymous[2] not in page and no_credit[2] not in page
    shed_only = member.get(reverse("dashboard:requests"), {"outcome": "shed"}).content.decode()
    assert shed_only.count('data-testid="refused-row"') == 1 and 'data-testid="request-row"' not in shed_only

    # The usage page counts them beside the failed requests, linking to them.
    usage = member.get(reverse("dashboard:usage")).content.decode()
    assert f'id="usage-refused">{len(tenant_refusals)}<' in usage and 'id="usage-shed">1<' in usage

    # The operator's error figure counts every refusal among the requests, served ones too.
    operator = Client()
    operator.force_login(UserFactory(role=User.Role.OPERATOR, tenant=None))
    home = operator.get(reverse("dashboard:home")).content.decode()
    # Beside them, only the gateway's readiness probes: keyless requests to /v1/models (401).
    written = Refusal.objects.aggregate(n=Sum("count"))["n"]
    probes = Refusal.objects.exclude(request_id__in=[r for _, _, r in every])
    assert written >= len(every) and all(row.status == 401 and row.tenant_id is None for row in probes)
    assert f'id="home-errors">{written}<' in home and f"of {written + served} requests" in home
    assert 'id="home-shed">1<' in home

    # /metrics counted the same refusals, the shed one under its own outcome.
    after = _requests_counted(refusal_gateway.url)
    counted = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    assert counted[("shed", "429")] == 1
    assert counted[("rejected", "429")] == 2 and counted[("rejected", "401")] == 1
    assert all(counted[("rejected", str(status))] == 1 for status in (400, 404, 413))
    assert counted[("failed", "503")] == 1

    # Nothing was charged for any of them: only the served requests have records.
    world.settled()
    assert not CreditHold.objects.exists()
    assert list(UsageRecord.objects.values_list("status", flat=True)) == ["completed"] * served
    assert CreditAccount.objects.get(tenant=world.tenant).balance == Decimal("10") - PRICE * served


def test_refusals_of_models_files_batches_and_stored_responses_are_counted_with_their_endpoint(
    refusal_gateway, replicas
):
    world = make_world(refusal_gateway, replicas, price=PRICE)
    client = world.client()
    by = ("endpoint", "outcome", "status")
    before = _requests_counted(refusal_gateway.url, by)
    assert [m.id for m in client.models.list()] == [world.model.public_name]  # served: counted, not refused
    # Key -> (status, code, request id, endpoint label) of each refusal.
    refused = {
        "bad key": (
            *_refused(openai.AuthenticationError, lambda: world.client("sk-not-a-key").models.list()),
            "/v1/models",
        ),
        "file too large": (
            *_refused(
                openai.APIStatusError,
                lambda: client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 70_000)), purpose="batch"),
            ),
            "/v1/files",
        ),
        "unknown batch": (
            *_refused(openai.NotFoundError, lambda: client.batches.retrieve("batch_unknown")),
            "/v1/batches/{batch_id}",
        ),
        "unknown response": (
            *_refused(openai.NotFoundError, lambda: client.responses.retrieve("resp_unknown")),
            "/v1/responses/{response_id}",
        ),
        "response deleted twice": (
            *_refused(openai.NotFoundError, lambda: client.responses.delete("resp_unknown")),
            "/v1/responses/{response_id}",
        ),
        # Too large to be read: refused before its key was checked, and still its tenant's.
        "response too large": (
            *_refused(
                openai.APIStatusError,
                lambda: client.responses.create(model=world.model.public_name, input="x" * MAX_BYTES),
            ),
            "/v1/responses",
        ),
    }
    assert {name: figures[:2] for name, figures in refused.items()} == {
        "bad key": (401, "invalid_api_key"),
        "file too large": (413, "file_too_large"),
        "unknown batch": (404, "not_found"),
        "unknown response": (404, "response_not_found"),
        "response deleted twice": (404, "response_not_found"),
        "response too large": (413, "request_too_large"),
    }
    # Refusals of one kind within a minute are one tally: the two unknown responses' is the latest's.
    tenant_refusals = {name: figures for name, figures in refused.items() if name != "bad key"}
    wait_until(
        lambda: (
            Refusal.objects.filter(tenant=world.tenant).aggregate(n=Sum("count"))["n"] == len(tenant_refusals)
            and Refusal.objects.filter(request_id=refused["bad key"][2]).exists()
        ),
        20,
        "the refusals to be written",
    )
    for name, (status, code, request_id, endpoint) in tenant_refusals.items():
        if name == "unknown response":
            continue
        row = Refusal.objects.get(request_id=request_id)
        assert (row.tenant_id, row.api_key_id, row.endpoint, row.status, row.error_code, row.count) == (
            world.tenant.pk,
            world.api_key.pk,
            endpoint,
            status,
            code,
            2 if name == "response deleted twice" else 1,
        )
    assert Refusal.objects.get(request_id=refused["bad key"][2]).tenant_id is None

    member = Client()
    member.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=world.tenant))
    page = member.get(reverse("dashboard:requests"), {"outcome": "refused"}).content.decode()
    shown = [name for name, (_, _, request_id, _) in refused.items() if f'data-request-id="{request_id}"' in page]
    assert shown == ["file too large", "unknown batch", "response deleted twice", "response too large"]

    # The operator's figure: every refusal written, the gateway's readiness probes' (bad keys) too.
    operator = Client()
    operator.force_login(UserFactory(role=User.Role.OPERATOR, tenant=None))
    home = operator.get(reverse("dashboard:home")).content.decode()
    written = Refusal.objects.aggregate(n=Sum("count"))["n"]
    assert written >= len(refused) and f'id="home-errors">{written}<' in home

    after = _requests_counted(refusal_gateway.url, by)
    counted = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    assert counted[("/v1/models", "completed", "200")] == 1
    for status, _, _, endpoint in refused.values():
        expected = sum(1 for s, _, _, e in refused.values() if (s, e) == (status, endpoint))
        assert counted[(endpoint, "rejected", str(status))] == expected
    assert not UsageRecord.objects.exists() and not CreditHold.objects.exists()


@pytest.fixture(scope="module")
def routes_gateway(database_url):
    """This module's gateway for refusals that need no replica: its tallies written every 0.2 s."""
    server = start_gateway(
        database_url,
        os.environ["REDIS_URL"],
        METRICS_TOKEN=TOKEN,
        GATEWAY_REFUSAL_FLUSH_SECONDS="0.2",
    )
    yield server
    server.stop()


# Every /v1 route but the five served ones (their refusals are above), and the router's own refusals.
# (method, path, endpoint label, status, error code (else type)).
OTHER_ROUTES = [
    ("GET", "/v1/models", "/v1/models", 401, "invalid_api_key"),
    ("GET", "/v1/models/any-model", "/v1/models/{model:path}", 401, "invalid_api_key"),
    ("POST", "/v1/files", "/v1/files", 401, "invalid_api_key"),
    ("GET", "/v1/files", "/v1/files", 401, "invalid_api_key"),
    ("GET", "/v1/files/file_any", "/v1/files/{file_id}", 401, "invalid_api_key"),
    ("DELETE", "/v1/files/file_any", "/v1/files/{file_id}", 401, "invalid_api_key"),
    ("GET", "/v1/files/file_any/content", "/v1/files/{file_id}/content", 401, "invalid_api_key"),
    ("POST", "/v1/batches", "/v1/batches", 401, "invalid_api_key"),
    ("GET", "/v1/batches", "/v1/batches", 401, "invalid_api_key"),
    ("GET", "/v1/batches/batch_any", "/v1/batches/{batch_id}", 401, "invalid_api_key"),
    ("POST", "/v1/batches/batch_any/cancel", "/v1/batches/{batch_id}/cancel", 401, "invalid_api_key"),
    ("GET", "/v1/responses/resp_any", "/v1/responses/{response_id}", 401, "invalid_api_key"),
    ("DELETE", "/v1/responses/resp_any", "/v1/responses/{response_id}", 401, "invalid_api_key"),
    ("POST", "/v1/responses/resp_any/cancel", "/v1/responses/{response_id}/cancel", 401, "invalid_api_key"),
    ("GET", "/v1/responses/resp_any/input_items", "/v1/responses/{response_id}/input_items", 401, "invalid_api_key"),
    ("PUT", "/v1/models", "/v1/models", 405, "invalid_request_error"),  # a route, another method
    ("GET", "/v1/chat/completions", "/v1/chat/completions", 405, "invalid_request_error"),
    ("GET", "/v1/no/such/endpoint", "", 404, "invalid_request_error"),  # no route: no label
]


@pytest.mark.parametrize(("method", "path", "endpoint", "status", "code"), OTHER_ROUTES)
def test_a_refusal_on_any_v1_route_is_tallied_and_counted_with_its_endpoint(
    routes_gateway, method, path, endpoint, status, code
):
    by = ("endpoint", "outcome", "status")
    before = _requests_counted(routes_gateway.url, by)
    response = httpx.request(
        method, f"{routes_gateway.url}{path}", headers={"Authorization": "Bearer sk-not-a-key"}, timeout=10
    )
    error = response.json()["error"]
    assert (response.status_code, error["code"] or error["type"]) == (status, code)
    request_id = response.headers["x-request-id"]

    wait_until(lambda: Refusal.objects.filter(request_id=request_id).exists(), 20, "the refusal to be written")
    row = Refusal.objects.get(request_id=request_id)
    assert (row.endpoint, row.status, row.error_code, row.tenant_id) == (endpoint, status, code, None)
    after = _requests_counted(routes_gateway.url, by)
    key = (endpoint, "rejected", str(status))
    assert after.get(key, 0) - before.get(key, 0) == 1


def test_a_shed_message_is_anthropics_529_overloaded_error_and_a_shed_response_openais_429(refusal_gateway, replicas):
    world = make_world(refusal_gateway, replicas, price=PRICE)
    world.model.deployment.ttft_slo_ms = 2000
    world.model.deployment.save()
    report_at = _report_load(world, waiting_tokens=50_000, prefill_tokens_per_s=1000.0)
    _shed(world, world.client())  # the routing table has the report now
    response = httpx.post(
        f"{refusal_gateway.url}/v1/messages",
        headers={"x-api-key": world.api_key.plaintext, "anthropic-version": "2023-06-01"},
        json={"model": world.model.public_name, "max_tokens": 1, "messages": CHAT},
        timeout=30,
    )
    assert response.status_code == 529
    assert response.json()["error"]["type"] == "overloaded_error"
    # 50 s of queue over a 2 s objective: 48 s from the report, less the time since (prefilled).
    assert _drained_retry_after(response.headers["retry-after"], 48, report_at)
    request_id = response.headers["request-id"]
    wait_until(lambda: Refusal.objects.filter(request_id=request_id).exists(), 20, "the refusal to be written")
    refusal = Refusal.objects.get(request_id=request_id)
    assert (refusal.status, refusal.error_code, refusal.tenant_id) == (529, "overloaded", world.tenant.pk)
    world.settled()
    assert not UsageRecord.objects.filter(request_id=request_id).exists()
    # Its concurrency slots, its count on the replica and its prompt tokens there were freed at once.
    shared = redis.Redis.from_url(refusal_gateway.redis_url)
    busy = [f"gw:busy:key:{world.api_key.pk}", f"gw:busy:tenant:{world.tenant.pk}"]
    outstanding = [f"gw:{kind}:{replica.pk}" for replica in world.replicas for kind in ("outstanding", "routed")]
    assert [shared.zcard(key) for key in busy + outstanding] == [0] * (len(busy) + len(outstanding))
    shared.close()

    # The Responses API answers in OpenAI's own error shape, as the chat completions do.
    with pytest.raises(openai.RateLimitError) as shed:
        world.client().responses.create(model=world.model.public_name, input="Refuse me.", max_output_tokens=16)
    assert shed.value.code == "overloaded"
    assert _drained_retry_after(shed.value.response.headers["retry-after"], 48, report_at)


def test_refusals_are_written_as_tallies_bounded_by_their_kinds_not_their_number():
    """A thousand bad-key refusals in a minute are one row; past max_kinds, new kinds lose their
    tenant and key but keep their count."""
    tenant = TenantFactory()
    keys = [ApiKeyFactory(tenant=tenant) for _ in range(4)]
    minute = 60 * 29_000_000  # a minute's start, in epoch seconds

    async def refuse() -> None:
        lane = DatabaseLane("refusals-test")
        log = RefusalLog(lane, flush_s=3600, max_kinds=3)
        for i in range(1000):
            log.add(
                status=401,
                error_code="invalid_api_key",
                reason="Incorrect API key provided.",
                request_id=f"req_bad_{i}",
                tenant_id=None,
                api_key_id=None,
                model_id=None,
                endpoint="/v1/chat/completions",
                at=minute + i * 0.05,
            )
        for key in keys:
            common = {"status": 429, "error_code": "rate_limit_exceeded", "reason": "Rate limit reached", "at": minute}
            common["endpoint"] = "/v1/chat/completions"
            log.add(**common, request_id=f"req_{key.pk}", tenant_id=tenant.pk, api_key_id=key.pk, model_id=None)
        try:
            assert log.pending == 4  # 3 kinds, then the fourth key's counted without its tenant
            await log.aclose()
            assert log.pending == 0
        finally:
            lane.close()  # and its thread's connection, which would outlive the test database

    asyncio.run(refuse())
    rows = list(Refusal.objects.order_by("id"))
    assert len(rows) == 4 and sum(row.count for row in rows) == 1004
    assert all(row.minute == datetime.fromtimestamp(minute, UTC) for row in rows)
    bad_key = rows[0]
    assert (bad_key.tenant_id, bad_key.status, bad_key.count, bad_key.request_id) == (None, 401, 1000, "req_bad_999")
    assert [(row.api_key_id, row.count) for row in rows[1:]] == [(keys[0].pk, 1), (keys[1].pk, 1), (None, 2)]


def _bad_key_refusal(log: RefusalLog, request_id: str) -> None:
    log.add(
        status=401,
        error_code="invalid_api_key",
        reason="Incorrect API key provided.",
        request_id=request_id,
        tenant_id=None,
        api_key_id=None,
        model_id=None,
        endpoint=f"/v1/{request_id}",
        at=time.time(),
    )


def test_a_refusal_counted_while_a_flush_waits_on_the_lane_is_written_with_no_refusal_after_it():
    """The flush lane is shared with settlements: a flush that has taken the tallies may wait on
    it. A refusal counted meanwhile, the last one for a while, is written all the same."""

    async def refuse() -> None:
        lane = DatabaseLane("refusals-test")
        log = RefusalLog(lane, flush_s=0.01)
        busy = threading.Event()
        settling = asyncio.ensure_future(lane.run(busy.wait))  # the lane's thread, taken
        try:
            _bad_key_refusal(log, "req_first")
            deadline = time.monotonic() + 30
            while log.pending:  # until the flush has taken it and waits for the lane
                assert time.monotonic() < deadline, "the flush never started"
                await asyncio.sleep(0.01)
            _bad_key_refusal(log, "req_second")
            busy.set()
            await settling
            while not await lane.run(Refusal.objects.filter(request_id="req_second").exists):
                assert time.monotonic() < deadline, "the refusal counted during a flush was never written"
                await asyncio.sleep(0.05)
            assert log.pending == 0
        finally:
            busy.set()
            await log.aclose()
            lane.close()

    asyncio.run(refuse())
    assert sorted(Refusal.objects.values_list("request_id", "count")) == [("req_first", 1), ("req_second", 1)]
