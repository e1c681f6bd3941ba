"""Redis or PostgreSQL unreachable: /v1 answers 503 with retry-after, /readyz names the dependency,
requests in flight finish and are settled, and key changes reach the gateway's key cache through
the database (within a poll) whether or not Redis could announce them.

The gateway here has a Redis of its own (a `redis-server` this module starts and stops) and
reaches the test database through a TCP proxy the tests can cut: the machine's shared Redis and
PostgreSQL are never stopped. Its key cache is trusted for ten minutes, so a change that takes
effect here did so through the change feed, not the cache's TTL.

The figures each test measures (from the fault's end, or from the change, to its effect) are
printed; run with `-s` to see them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

import httpx
import openai
import pytest
import redis
from django.utils import timezone

from controlplane.accounts.services import API_KEY_CHANGES_CHANNEL, api_key_revoke
from controlplane.billing.models import CreditHold, UsageRecord
from tests.controlplane.gateway.conftest import free_port, make_world, start_gateway, wait_ready, wait_until
from tests.private_services import PrivateRedis

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "hi"}]
RETRY_AFTER_S = 3  # start_gateway's GATEWAY_RETRY_AFTER_SECONDS


class DatabaseProxy:
    """A TCP forwarder in front of the test database. `cut()` drops every connection through it
    and refuses new ones (the gateway loses its database; the database itself and this test's
    own connection are untouched); `restore()` listens again on the same port."""

    def __init__(self, host: str, port: int):
        self.target, self.port = (host, port), free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.Transport] = set()
        self.restore()

    @property
    def is_cut(self) -> bool:
        return self._server is None

    def restore(self) -> None:
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)

    def cut(self) -> None:
        asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port, reuse_address=True)

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer.transport, up_writer.transport}
        self._transports |= pair
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)
        self._transports -= pair
        for transport in pair:
            transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    server = PrivateRedis(tmp_path_factory.mktemp("outage-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def database_proxy(database_url):
    parts = urlsplit(database_url)
    proxy = DatabaseProxy(parts.hostname, parts.port or 5432)
    proxy.proxied_url = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[0] + f"@127.0.0.1:{proxy.port}"))
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def outage_gateway(replica_processes, private_redis, database_proxy):
    server = start_gateway(database_proxy.proxied_url, private_redis.url, GATEWAY_KEY_CACHE_SECONDS="600")
    yield server
    server.stop()


@pytest.fixture
def world(outage_gateway, replica_processes, private_redis, database_proxy, settings):
    settings.REDIS_URL = private_redis.url  # this process announces key changes where the gateway listens
    for server in replica_processes:
        wait_ready(server)
    yield make_world(outage_gateway, replica_processes)
    # Whatever a test broke is back before the next one, and every request is settled before the
    # test's tables are emptied.
    if database_proxy.is_cut:
        database_proxy.restore()
    if not private_redis.running:
        private_redis.start()
    wait_until(lambda: not CreditHold.objects.exists(), 60, "every request to be settled")


def _chat_http(world, api_key: str | None = None, **body) -> httpx.Response:
    return httpx.post(
        f"{world.base_url}/v1/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {api_key or world.api_key.plaintext}"},
        json={"model": world.model.public_name, "messages": CHAT, "max_tokens": 2, **body},
    )


def _models_status(world, api_key: str | None = None) -> tuple[int, set[str]]:
    response = httpx.get(
        f"{world.base_url}/v1/models",
        timeout=10,
        headers={"Authorization": f"Bearer {api_key or world.api_key.plaintext}"},
    )
    return response.status_code, {m["id"] for m in response.json().get("data", [])} if response.is_success else set()


def _assert_unavailable(response: httpx.Response, code: str, names: str, secrets: list[str]) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) == RETRY_AFTER_S
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == code
    assert names in error["message"]
    for secret in secrets:  # no host, port or user of the dependency
        assert secret not in response.text


def _ready(world) -> httpx.Response:
    return httpx.get(f"{world.base_url}/readyz", timeout=10)


def _stream_through(world, fault) -> str:
    """Stream 150 tokens, calling `fault()` once the first has arrived; checks that the stream
    still ends as a whole, well-formed answer and returns its request id."""
    with httpx.stream(
        "POST",
        f"{world.base_url}/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {world.api_key.plaintext}"},
        json={
            "model": world.model.public_name,
            "messages": CHAT,
            "max_tokens": 150,
            "ignore_eos": True,
            "stream": True,
        },
    ) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        fault()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"error"' not in "".join(rest)
    return request_id


def _wait(check, timeout: float, what: str) -> float:
    """Wait until `check()`; returns how long that took (the measured figure)."""
    started = time.monotonic()
    wait_until(check, timeout, what)
    return time.monotonic() - started


# --- Redis down ---------------------------------------------------------------------------------


def test_redis_down_is_a_503_with_retry_after_and_readiness_names_redis(world, private_redis):
    assert _chat_http(world).status_code == 200  # the key is cached now
    private_redis.stop()
    try:
        for stream in (False, True):
            _assert_unavailable(
                _chat_http(world, stream=stream), "redis_unavailable", "Redis", [str(private_redis.port), "127.0.0.1"]
            )
        ready = _ready(world)
        assert ready.status_code == 503
        assert ready.json()["checks"] == {"database": "ok", "redis": "unreachable"}
        assert "redis" in ready.json()["message"] and str(private_redis.port) not in ready.text
    finally:
        private_redis.start()
    recovered = _wait(lambda: _chat_http(world).status_code == 200, 30, "requests to succeed again")
    assert _ready(world).status_code == 200
    print(f"\n[measured] Redis back -> first 200: {recovered:.3f} s")


def test_a_stream_in_flight_when_redis_goes_away_finishes_and_is_billed(world, private_redis):
    request_id = _stream_through(world, private_redis.stop)
    wait_until(lambda: UsageRecord.objects.filter(request_id=request_id).exists(), 30, "the settlement")
    record = UsageRecord.objects.get(request_id=request_id)
    assert record.status == UsageRecord.Status.COMPLETED and record.completion_tokens == 150


def test_a_revocation_made_while_redis_is_down_takes_effect_without_it(world, private_redis):
    assert _models_status(world)[0] == 200  # the key is cached now, for ten minutes
    private_redis.stop()
    api_key_revoke(api_key=world.api_key)  # its announcement is lost: nobody is listening
    took = _wait(lambda: _models_status(world)[0] == 401, 20, "the revoked key to be refused")
    print(f"\n[measured] revocation during a Redis outage -> refused: {took:.3f} s")
    private_redis.start()
    response = _chat_http(world)
    assert response.status_code == 401 and "revoked" in response.json()["error"]["message"]


def _revoke(world):
    api_key_revoke(api_key=world.api_key)


def _deactivate_tenant(world):
    world.tenant.is_active = False
    world.tenant.save()


def _expire_key(world):
    world.api_key.expires_at = timezone.now() - timedelta(seconds=1)
    world.api_key.save()


def _allow_other_models_only(world):
    from tests.controlplane.factories import ModelFactory

    world.api_key.all_models = False
    world.api_key.save()
    world.api_key.allowed_models.set([ModelFactory()])


def _lower_rate_limit(world):
    world.api_key.rate_limit_per_minute = 1
    world.api_key.save()


def _refused(world) -> bool:
    return _models_status(world)[0] == 401


def _model_hidden(world) -> bool:
    return world.model.public_name not in _models_status(world)[1]


def _rate_limited(world) -> bool:
    return _chat_http(world).status_code == 429


@pytest.mark.parametrize(
    "change, in_effect",
    [
        (_revoke, _refused),
        (_deactivate_tenant, _refused),
        (_expire_key, _refused),
        (_allow_other_models_only, _model_hidden),
        (_lower_rate_limit, _rate_limited),
    ],
    ids=["key-revoked", "tenant-deactivated", "key-expired", "allowed-models", "rate-limit"],
)
def test_key_changes_whose_announcement_is_lost_reach_a_healthy_gateway(
    world, private_redis, settings, change, in_effect
):
    """The gateway is subscribed to the announcements the whole time; the process making the
    change cannot reach Redis, so its announcement is lost. The database still carries it."""
    listening = redis.Redis.from_url(private_redis.url)
    wait_until(
        lambda: dict(listening.pubsub_numsub(API_KEY_CHANGES_CHANNEL))[API_KEY_CHANGES_CHANNEL.encode()] > 0,
        30,
        "the gateway to listen for key changes",
    )
    status, models = _models_status(world)
    assert status == 200 and world.model.public_name in models  # cached now, for ten minutes
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    changed = time.monotonic()
    change(world)
    took = _wait(lambda: in_effect(world), 20, "the change to take effect")
    print(
        f"\n[measured] {change.__name__}, announcement lost -> in effect: {time.monotonic() - changed:.3f} s "
        f"(waited {took:.3f} s)"
    )


def test_an_announced_change_takes_effect_at_once(world):
    assert _models_status(world)[0] == 200
    _lower_rate_limit(world)
    took = _wait(lambda: _rate_limited(world), 20, "the new limit to refuse a request")
    print(f"\n[measured] lower rate limit, announced -> 429: {took:.3f} s")


# --- PostgreSQL down ----------------------------------------------------------------------------


def test_database_down_is_a_503_with_retry_after_and_readiness_names_the_database(world, database_proxy):
    from tests.controlplane.factories import ApiKeyFactory

    assert _chat_http(world).status_code == 200  # this key is cached; the next one is not
    uncached = ApiKeyFactory(tenant=world.tenant)
    database_proxy.cut()
    try:
        secrets = [str(database_proxy.port), "postgres"]
        _assert_unavailable(_chat_http(world), "database_unavailable", "database", secrets)  # its credit hold
        _assert_unavailable(_chat_http(world, uncached.plaintext), "database_unavailable", "database", secrets)
        ready = _ready(world)
        assert ready.status_code == 503
        assert ready.json()["checks"] == {"database": "unreachable", "redis": "ok"}
        assert "database" in ready.json()["message"]
        # Made while the gateway cannot read it: it must take effect once the gateway can.
        api_key_revoke(api_key=world.api_key)
    finally:
        database_proxy.restore()
    back = _wait(lambda: _models_status(world)[0] == 401, 20, "the revocation to take effect")
    print(f"\n[measured] database back -> revocation made meanwhile in effect: {back:.3f} s")
    wait_until(lambda: _chat_http(world, uncached.plaintext).status_code == 200, 30, "requests to succeed")
    assert _ready(world).status_code == 200


def test_a_cold_start_that_needs_the_database_while_it_is_down_is_a_503_at_once_then_heals(
    outage_gateway, world, database_proxy
):
    from controlplane.catalog.models import Deployment
    from tests.controlplane.gateway.test_cold_start import cold_world

    cold = cold_world(outage_gateway)  # scaled to zero; listing it cached its key
    database_proxy.cut()
    try:
        # Waking the deployment needs the database: a clear 503 now, not a wait that cannot end well.
        _assert_unavailable(_chat_http(cold), "database_unavailable", "database", [str(database_proxy.port)])
    finally:
        database_proxy.restore()
    assert Deployment.objects.get(model=cold.model).desired_replicas == 0
    # Back: the next request wakes it (and, with no replica loading here, waits its 2 s in vain).
    wait_until(lambda: _chat_http(cold).json()["error"]["code"] == "cold_start_timeout", 60, "a cold start to wait")
    assert Deployment.objects.get(model=cold.model).desired_replicas == 1
    assert not UsageRecord.objects.filter(tenant=cold.tenant).exists()


def test_a_stream_that_ends_while_the_database_is_away_is_settled_when_it_returns(world, database_proxy):
    request_id = _stream_through(world, database_proxy.cut)
    # The outage lasts longer than a settlement used to be retried for (2.5 s); the hold outlives
    # the test by ten minutes, so the sweeper is not what settles it.
    time.sleep(5)
    assert not UsageRecord.objects.filter(request_id=request_id).exists()
    database_proxy.restore()
    took = _wait(lambda: UsageRecord.objects.filter(request_id=request_id).exists(), 60, "the settlement")
    print(f"\n[measured] database back -> stream settled: {took:.3f} s")
    record = UsageRecord.objects.get(request_id=request_id)
    assert record.status == UsageRecord.Status.COMPLETED and record.completion_tokens == 150
    assert not CreditHold.objects.filter(request_id=request_id).exists()


def test_openai_sdk_sees_a_retryable_503(world, private_redis):
    client = world.client()
    client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
    private_redis.stop()
    with pytest.raises(openai.InternalServerError) as error:
        client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
    assert error.value.status_code == 503 and error.value.code == "redis_unavailable"
