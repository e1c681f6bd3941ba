"""Cold starts through the running gateway: a request for a model with no ready replica (scaled to
zero) wakes its deployment and waits while a replica loads, instead of a 503; the wait is bounded
in time and in size, a client that leaves gives up its place, nothing is billed unless served."""

import json
import socket
import threading
import time
from decimal import Decimal

import httpx
import openai
import pytest
from django.db import connections
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.billing.models import CreditHold, UsageRecord
from controlplane.billing.selectors import credit_balance
from controlplane.catalog.models import Deployment
from controlplane.fleet import heartbeat_cache
from controlplane.fleet.cold_start_counts import cold_start_waiting, waiting_in_redis
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.services.replicas import replica_transition
from tests.controlplane.gateway.conftest import World, start_gateway, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "Say hello."}]
GB = 1024**3
PRICE = Decimal("0.002")
# Generous: the tests end the wait themselves (a replica turns ready, the client leaves), and a
# request that wrongly waited the whole time shows in its error code, not in a timing.
LONG_WAIT_S = 120


@pytest.fixture(scope="module")
def patient_gateway(replica_processes, database_url, gateway):
    """A gateway whose cold starts wait long, with room for one waiting request per model."""
    server = start_gateway(
        database_url,
        gateway.redis_url,
        GATEWAY_COLD_START_WAIT_SECONDS=str(LONG_WAIT_S),
        GATEWAY_COLD_START_QUEUE_MAX="1",
    )
    yield server
    server.stop()


def cold_world(
    gateway, *, worker_memory_bytes: int = 64 * GB, credit: Decimal = Decimal("10"), **deployment_fields
) -> World:
    """A tenant and a model scaled to zero (no replica at all) that an online worker could hold;
    returns once the gateway lists the model (it can cold-start)."""
    from controlplane.billing.services import credit_grant
    from tests.controlplane.factories import (
        ApiKeyFactory,
        DeploymentFactory,
        ModelFactory,
        PlanFactory,
        PriceTierFactory,
        TenantFactory,
    )

    tenant = TenantFactory(plan=PlanFactory(rate_limit_per_minute=10_000, max_concurrent_requests=50))
    if credit:
        credit_grant(tenant=tenant, amount=credit)
    api_key = ApiKeyFactory(tenant=tenant)
    model = ModelFactory(
        price_tier=PriceTierFactory(price_per_request=PRICE), context_length=256, gpu_memory_bytes=8 * GB
    )
    DeploymentFactory(model=model, **{"desired_replicas": 0, "min_replicas": 0, "max_replicas": 2, **deployment_fields})
    Worker.objects.create(
        name=f"host-{model.pk}",
        queue_name=f"gpuworker.host-{model.pk}",
        advertise_host="127.0.0.1",
        device=Worker.Device.CPU,
        cpu_memory_total_bytes=worker_memory_bytes,
    )
    world = World(tenant, api_key, model, [], gateway.url)
    wait_until(
        lambda: model.public_name in {m.id for m in world.client().models.list()},
        10,
        f"the gateway to list {model.public_name}",
    )
    return world


def _waiting(gateway, world) -> int:
    return waiting_in_redis(gateway.redis_url, [world.model.pk])[world.model.pk]


def _desired(world) -> int:
    return Deployment.objects.get(model=world.model).desired_replicas


def _make_ready(world, server) -> Replica:
    """What reconcile and the worker's heartbeats would do: a replica placed, loading, then ready."""
    deployment = Deployment.objects.get(model=world.model)
    replica = Replica.objects.create(
        deployment=deployment, worker=Worker.objects.get(name=f"host-{world.model.pk}"), state=Replica.State.PENDING
    )
    replica_transition(replica=replica, to_state=Replica.State.LOADING, at=timezone.now())
    return replica_transition(replica=replica, to_state=Replica.State.READY, at=timezone.now(), endpoint_url=server.url)


def _in_thread(work):
    """Run `work` in a thread; returns (thread, outcome) where outcome gets "result" or "error"."""
    outcome = {}

    def run():
        try:
            outcome["result"] = work()
        except Exception as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_request_for_a_model_scaled_to_zero_waits_for_its_replica_and_is_billed_once(patient_gateway, replicas):
    world = cold_world(patient_gateway)
    client = world.client(timeout=LONG_WAIT_S + 30)
    thread, outcome = _in_thread(
        lambda: client.chat.completions.with_raw_response.create(
            model=world.model.public_name, messages=CHAT, max_tokens=4
        )
    )
    try:
        # The gateway woke the deployment (as the system, in the audit log) and counts the request
        # as waiting where the autoscaler reads it.
        wait_until(lambda: _desired(world) == 1, 30, "the deployment to be woken")
        wait_until(lambda: _waiting(patient_gateway, world) == 1, 30, "the request to wait")
        entry = AuditEntry.objects.get(
            action=AuditEntry.Action.DEPLOYMENT_SCALE, target_id=str(world.model.deployment.pk)
        )
        assert entry.actor_label == "system" and "cold start" in entry.detail["reason"]
        assert "result" not in outcome and "error" not in outcome  # still waiting
        _make_ready(world, replicas[0])
    finally:
        thread.join(LONG_WAIT_S + 60)
    assert "error" not in outcome, outcome.get("error")
    response = outcome["result"]
    assert float(response.headers["x-gpuserve-cold-start"]) > 0
    assert response.parse().choices[0].message.content is not None
    assert _waiting(patient_gateway, world) == 0
    world.settled()
    [record] = UsageRecord.objects.filter(tenant=world.tenant)
    assert (record.status, record.price_charged) == ("completed", PRICE)
    assert credit_balance(tenant=world.tenant) == Decimal("10") - PRICE
    # Served from a ready replica now: no cold start, no header.
    again = client.chat.completions.with_raw_response.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
    assert "x-gpuserve-cold-start" not in again.headers


def test_a_streaming_request_that_waited_says_so_in_its_headers(patient_gateway, replicas):
    world = cold_world(patient_gateway)
    client = world.client(timeout=LONG_WAIT_S + 30)

    def stream():
        with client.chat.completions.with_streaming_response.create(
            model=world.model.public_name, messages=CHAT, max_tokens=3, stream=True
        ) as response:
            return response.headers.get("x-gpuserve-cold-start"), [chunk for chunk in response.iter_lines() if chunk]

    thread, outcome = _in_thread(stream)
    try:
        wait_until(lambda: _waiting(patient_gateway, world) == 1, 30, "the request to wait")
        _make_ready(world, replicas[1])
    finally:
        thread.join(LONG_WAIT_S + 60)
    assert "error" not in outcome, outcome.get("error")
    header, lines = outcome["result"]
    assert header is not None and float(header) > 0 and lines[-1] == "data: [DONE]"
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() == 1


def test_a_request_that_waited_for_a_cold_start_is_not_shed_by_the_objective_the_next_one_is(
    patient_gateway, replicas, settings
):
    # The new replica's first load report predicts a wait far over the deployment's objective
    # (written to the live cache the gateway reads, on its Redis database).
    settings.CACHES = {**settings.CACHES, "live": {**settings.CACHES["live"], "LOCATION": patient_gateway.redis_url}}
    world = cold_world(patient_gateway, ttft_slo_ms=500)
    client = world.client(timeout=LONG_WAIT_S + 30)
    thread, outcome = _in_thread(
        lambda: client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
    )
    try:
        wait_until(lambda: _waiting(patient_gateway, world) == 1, 30, "the request to wait")
        deployment = Deployment.objects.get(model=world.model)
        replica = Replica.objects.create(
            deployment=deployment, worker=Worker.objects.get(name=f"host-{world.model.pk}"), state=Replica.State.PENDING
        )
        # Stored before the replica turns ready: every routing table that lists it has the report.
        heartbeat_cache.store(
            worker_id=replica.worker_id,
            state={
                "received_at": time.time(),
                "replicas": {str(replica.pk): {"waiting_tokens": 50_000, "prefill_tokens_per_s": 1000.0}},
            },
        )
        replica_transition(replica=replica, to_state=Replica.State.LOADING, at=timezone.now())
        replica_transition(
            replica=replica, to_state=Replica.State.READY, at=timezone.now(), endpoint_url=replicas[0].url
        )
    finally:
        thread.join(LONG_WAIT_S + 60)
    assert "error" not in outcome, outcome.get("error")  # it waited: served, not shed
    # A request arriving now, by the same report, is shed at once.
    with pytest.raises(openai.RateLimitError) as shed:
        client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
    assert shed.value.code == "overloaded"
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() == 1


def test_a_cold_start_that_does_not_finish_in_time_is_503_with_retry_after_unbilled(gateway, replicas):
    # The session's gateway waits 2 s (GATEWAY_COLD_START_WAIT_SECONDS in conftest).
    world = cold_world(gateway)
    with pytest.raises(openai.InternalServerError) as error:
        world.client().chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=4)
    response = error.value.response
    assert response.status_code == 503 and error.value.code == "cold_start_timeout"
    assert response.headers["retry-after"] == "3" and float(response.headers["x-gpuserve-cold-start"]) >= 2
    assert _desired(world) == 1  # the replica it asked for keeps loading for the next requests
    assert _waiting(gateway, world) == 0
    assert not UsageRecord.objects.exists() and not CreditHold.objects.exists()
    assert credit_balance(tenant=world.tenant) == Decimal("10")


def test_a_request_out_of_credit_is_refused_at_once_and_wakes_nothing(patient_gateway, replicas):
    # Admission (rate and concurrency limits) and the credit hold come before the wait: refused
    # without waking the model (a refusal after the wait would be a 503 cold_start_timeout,
    # LONG_WAIT_S later, with the deployment woken for nothing).
    world = cold_world(patient_gateway, credit=Decimal("0"))
    with pytest.raises(openai.RateLimitError) as error:
        world.client().chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
    assert error.value.code == "insufficient_quota"
    assert _desired(world) == 0 and _waiting(patient_gateway, world) == 0
    assert not UsageRecord.objects.exists() and not CreditHold.objects.exists()


def test_a_full_cold_start_queue_answers_503_at_once(patient_gateway, replicas):
    world = cold_world(patient_gateway)  # one waiting request per model in this gateway
    client = world.client(timeout=LONG_WAIT_S + 30)
    thread, outcome = _in_thread(
        lambda: client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
    )
    try:
        wait_until(lambda: _waiting(patient_gateway, world) == 1, 30, "the first request to wait")
        with pytest.raises(openai.InternalServerError) as error:
            client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
        assert error.value.status_code == 503 and error.value.code == "cold_start_queue_full"
        assert error.value.response.headers["retry-after"] == "3"
        assert "GATEWAY_COLD_START_QUEUE_MAX" in error.value.message
        _make_ready(world, replicas[0])
    finally:
        thread.join(LONG_WAIT_S + 60)
    assert "error" not in outcome, outcome.get("error")  # the first one was served
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant).count() == 1


def test_a_client_that_leaves_while_waiting_gives_up_its_place_unbilled(patient_gateway, replicas):
    world = cold_world(patient_gateway)
    body = json.dumps({"model": world.model.public_name, "messages": CHAT, "max_tokens": 2}).encode()
    address = httpx.URL(world.base_url)
    with socket.create_connection((address.host, address.port)) as connection:
        connection.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + world.api_key.plaintext.encode() + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        wait_until(lambda: _waiting(patient_gateway, world) == 1, 30, "the request to wait")
    # The client went away mid-wait.
    wait_until(lambda: _waiting(patient_gateway, world) == 0, 30, "the request to leave the queue")
    # Its place is free: with a queue of one, another request can wait now (and is then served).
    client = world.client(timeout=LONG_WAIT_S + 30)
    thread, outcome = _in_thread(
        lambda: client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2)
    )
    try:
        wait_until(lambda: _waiting(patient_gateway, world) == 1, 30, "the second request to wait")
        _make_ready(world, replicas[0])
    finally:
        thread.join(LONG_WAIT_S + 60)
    assert "error" not in outcome, outcome.get("error")
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant).count() == 1  # the second one only


def test_a_model_that_cannot_start_a_replica_is_503_at_once_naming_why(patient_gateway, replicas):
    too_big = cold_world(patient_gateway)
    Worker.objects.filter(name=f"host-{too_big.model.pk}").update(cpu_memory_total_bytes=4 * GB)
    wait_until(
        lambda: too_big.model.public_name not in {m.id for m in too_big.client().models.list()},
        10,
        "the model to be unlisted",
    )
    with pytest.raises(openai.InternalServerError) as error:
        too_big.client().chat.completions.create(model=too_big.model.public_name, messages=CHAT, max_tokens=2)
    # Not after the long wait: a wait that ran out would say cold_start_timeout.
    assert error.value.code == "model_unavailable" and "needs 8.0 GiB" in error.value.message
    assert _desired(too_big) == 0 and not UsageRecord.objects.exists()


def test_models_lists_what_can_answer_now_or_start_a_replica(patient_gateway, replicas):
    from tests.controlplane.factories import DeploymentFactory, ModelFactory, WorkerFactory
    from tests.controlplane.gateway.conftest import make_world

    serving = make_world(patient_gateway, replicas)  # ready replicas (on a worker with no memory to spare)
    startable = ModelFactory(gpu_memory_bytes=8 * GB)
    DeploymentFactory(model=startable, desired_replicas=0, min_replicas=0, max_replicas=1)
    never = ModelFactory(gpu_memory_bytes=8 * GB)  # may have no replica
    DeploymentFactory(model=never, desired_replicas=0, min_replicas=0, max_replicas=0)
    too_big = ModelFactory(gpu_memory_bytes=80 * GB)  # kept warm, but no online worker could hold it
    DeploymentFactory(model=too_big, desired_replicas=0, min_replicas=0, max_replicas=1, keep_warm=True)
    undeployed = ModelFactory(gpu_memory_bytes=8 * GB)
    WorkerFactory(name="roomy", device=Worker.Device.CPU, cpu_memory_total_bytes=64 * GB)
    WorkerFactory(
        name="draining", device=Worker.Device.CPU, cpu_memory_total_bytes=128 * GB, state=Worker.State.DRAINING
    )  # a worker that takes no new replica does not count
    client = serving.client()
    wait_until(lambda: startable.public_name in {m.id for m in client.models.list()}, 10, "the startable model")
    listed = {m.id for m in client.models.list()}
    assert serving.model.public_name in listed and startable.public_name in listed
    assert not {never.public_name, too_big.public_name, undeployed.public_name} & listed
    assert client.models.retrieve(startable.public_name).id == startable.public_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(never.public_name)
    with pytest.raises(openai.InternalServerError) as error:
        client.chat.completions.create(model=undeployed.public_name, messages=CHAT, max_tokens=2)
    assert error.value.code == "model_unavailable" and "no deployment" in error.value.message


def test_without_redis_the_autoscaler_reads_the_waiting_count_from_the_live_cache(
    replica_processes, database_url, replicas, tmp_path, settings
):
    # The embedded set-up (`make run`): one gateway process, no Redis; the autoscaler runs in a
    # Celery process and reads the count from the live cache's files.
    var = tmp_path / "var"
    server = start_gateway(database_url, "", VAR_DIR=str(var), GATEWAY_COLD_START_WAIT_SECONDS=str(LONG_WAIT_S))
    try:
        world = cold_world(server)
        settings.REDIS_URL = ""
        settings.CACHES = {
            **settings.CACHES,
            "live": {
                "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
                "LOCATION": str(var / "cache" / "live"),
            },
        }
        model_id = world.model.pk
        assert cold_start_waiting(model_ids=[model_id]) == {model_id: 0}
        client = world.client(timeout=LONG_WAIT_S + 30)
        thread, outcome = _in_thread(
            lambda: client.chat.completions.with_raw_response.create(
                model=world.model.public_name, messages=CHAT, max_tokens=2
            )
        )
        try:
            wait_until(lambda: cold_start_waiting(model_ids=[model_id]) == {model_id: 1}, 30, "the request to wait")
            _make_ready(world, replicas[0])
        finally:
            thread.join(LONG_WAIT_S + 60)
        assert "error" not in outcome, outcome.get("error")
        assert "x-gpuserve-cold-start" in outcome["result"].headers
        assert cold_start_waiting(model_ids=[model_id]) == {model_id: 0}
        world.settled()
    finally:
        server.stop()
