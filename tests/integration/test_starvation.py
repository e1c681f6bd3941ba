"""Tenant traffic cannot take the fleet down: requests of 4 MB of token ids, eight at once, through
the real gateway (within a demo key's limits) leave the worker daemon's heartbeats flowing (they go
to the fleet server), the worker online and its replica up, and another tenant's stream whole."""

import json
import threading
import time
from decimal import Decimal

import httpx
import pytest
from django.db import connection

from controlplane.billing.services import credit_grant
from controlplane.catalog.models import Deployment
from controlplane.fleet import heartbeat_cache
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.services.deployments import deployment_scale
from tests.controlplane.factories import ApiKeyFactory, DeploymentFactory, ModelFactory, PlanFactory, TenantFactory
from tests.integration.conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ATTACKERS = 8
ROUNDS = 3  # each attacker sends its next request once the last is answered
# 2,000,000 token ids: 4 MB, within the gateway's 4 MiB body limit.
ATTACK = json.dumps({"prompt": [1] * 2_000_000}, separators=(",", ":")).encode()


def _tenant_key(rate_limit_per_minute: int = 60, max_concurrent_requests: int = 16):
    """A key of a tenant on the demo plan's limits, with credit."""
    tenant = TenantFactory(
        plan=PlanFactory(rate_limit_per_minute=rate_limit_per_minute, max_concurrent_requests=max_concurrent_requests)
    )
    credit_grant(tenant=tenant, amount=Decimal("100"))
    return ApiKeyFactory(tenant=tenant)


class HeartbeatWatch(threading.Thread):
    """Records each heartbeat the control plane stored for the worker (its receipt time)."""

    def __init__(self, worker_id: int):
        super().__init__(daemon=True)
        self.worker_id, self.received = worker_id, []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            latest = heartbeat_cache.read(worker_id=self.worker_id) or {}
            if latest.get("received_at") and latest["received_at"] not in self.received[-1:]:
                self.received.append(latest["received_at"])
            time.sleep(0.1)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def _attack(url: str, key: str, model: str, outcomes: list) -> None:
    body = ATTACK[:1] + f'"model":"{model}",'.encode() + ATTACK[1:]
    with httpx.Client(
        timeout=300, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    ) as client:
        for _ in range(ROUNDS):
            try:
                response = client.post(f"{url}/v1/completions", content=body)
                outcomes.append((response.status_code, response.json().get("error", {}).get("code")))
            except httpx.HTTPError as exc:
                outcomes.append((None, repr(exc)))


def _stream(url: str, key: str, model: str, result: dict) -> None:
    body = {"model": model, "prompt": "another tenant's stream", "max_tokens": 48, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=300, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            result["status"] = response.status_code
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)
        return
    result["done"] = events[-1:] == ["[DONE]"]
    result["errors"] = [event for event in events if event != "[DONE]" and "error" in json.loads(event)]


def test_eight_4mb_token_id_requests_at_once_leave_the_worker_online_and_every_replica_up(fleet, tiny_model_path):
    # The attack sends the largest body the gateway takes at all: the model's own limit (its context
    # times GATEWAY_REQUEST_BYTES_PER_TOKEN, 8 KiB of JSON a token) reaches GATEWAY_MAX_REQUEST_BYTES,
    # so every body is parsed in full before its prompt is found too long.
    fleet.env["GATEWAY_REQUEST_BYTES_PER_TOKEN"] = str(8 * 1024)
    fleet.restart_control_plane()
    fleet.start_daemon("a")
    worker = wait_until(
        lambda: Worker.objects.filter(state=Worker.State.ONLINE).first(),
        timeout=60,
        what="the daemon online",
        fleet=fleet,
    )
    model = ModelFactory(weights_path=str(tiny_model_path), context_length=512, gpu_memory_bytes=64 * 1024**2)
    deployment: Deployment = DeploymentFactory(model=model, desired_replicas=0, min_replicas=0, max_replicas=1)
    deployment_scale(deployment=deployment, desired_replicas=1, actor=None)
    replica = wait_until(
        lambda: Replica.objects.filter(deployment=deployment, state=Replica.State.READY).first(),
        timeout=180,
        what="the replica ready",
        fleet=fleet,
    )
    worker.refresh_from_db()
    attacker, other = _tenant_key(), _tenant_key()
    headers = {"Authorization": f"Bearer {other.plaintext}"}
    wait_until(
        lambda: any(
            m["id"] == model.public_name
            for m in httpx.get(f"{fleet.url}/v1/models", headers=headers, timeout=10).json()["data"]
        ),
        timeout=30,
        what="the gateway to route the model",
        fleet=fleet,
    )

    watch = HeartbeatWatch(worker.pk)
    watch.start()
    outcomes, streamed = [], {}
    attack = [
        threading.Thread(target=_attack, args=(fleet.url, attacker.plaintext, model.public_name, outcomes))
        for _ in range(ATTACKERS)
    ]
    stream = threading.Thread(target=_stream, args=(fleet.url, other.plaintext, model.public_name, streamed))
    started = time.time()
    for thread in attack:
        thread.start()
    stream.start()
    for thread in [*attack, stream]:
        thread.join(timeout=400)
    ended = time.time()
    watch.stop()
    connection.close()  # the watch's thread used one

    during = [t for t in watch.received if started <= t <= ended]
    gaps = [round(b - a, 2) for a, b in zip([started, *during], [*during, ended])]
    print(f"attack: {ended - started:.1f}s, outcomes {sorted(set(outcomes))}, heartbeat gaps (s): {gaps}")
    # Every attack request was refused cleanly: its prompt cannot fit the model's context.
    assert len(outcomes) == ATTACKERS * ROUNDS
    assert set(outcomes) == {(400, "context_length_exceeded")}, outcomes
    # Heartbeats were recorded while the attack ran, and the worker was never judged lost: it has
    # been online since before the attack, and its replica is the same one, still ready.
    assert during, "no heartbeat was recorded during the attack"
    after = Worker.objects.get(pk=worker.pk)
    assert after.state == Worker.State.ONLINE and after.state_changed_at == worker.state_changed_at
    assert list(Replica.objects.filter(deployment=deployment).values_list("pk", "state")) == [
        (replica.pk, Replica.State.READY)
    ]
    # The other tenant's stream was served whole.
    assert streamed.get("status") == 200 and streamed.get("done") and not streamed.get("errors"), streamed
