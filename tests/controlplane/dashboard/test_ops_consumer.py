"""The fleet page's WebSocket through the real ASGI stack (session auth, origin check) and the
real Redis channel layer: operators receive each heartbeat's figures, replica changes and new
workers as HTML fragments addressed by id; anyone else is turned away."""

import re
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.asgi import application
from controlplane.fleet.models import Replica
from controlplane.fleet.reconcile import deployment_reconcile
from controlplane.fleet.services.deployments import deployment_create, deployment_scale
from controlplane.fleet.services.replicas import replica_transition
from controlplane.fleet.services.workers import worker_register
from gpuworker.contract.heartbeat import parse_registration
from tests.controlplane.dashboard.ops_support import (  # noqa: F401 (fixtures)
    _private_live_cache,
    beat,
    make_user,
    make_worker,
)
from tests.controlplane.dashboard.websocket_client import WebSocketClient
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory, ReplicaFactory, TenantFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("redis_url")]


@pytest.fixture(autouse=True)
async def _close_worker_thread_connections():
    # The ORM work (the test's and the consumer's) runs on asgiref's one sync thread, whose
    # connection would otherwise outlive the test database.
    yield
    await sync_to_async(connections.close_all)()


@sync_to_async
def _session_cookie(role: str | None) -> str:
    if role is None:
        return ""
    client = Client()
    client.force_login(make_user(role))
    return f"sessionid={client.cookies['sessionid'].value}"


async def _connect(role: str | None) -> tuple[WebSocketClient, bool, int | None]:
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    cookie = await _session_cookie(role)
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    communicator = WebSocketClient(application, "/ws/fleet/", headers=headers)
    connected, code = await communicator.connect()
    return communicator, connected, code


@pytest.mark.parametrize("role", [None, User.Role.TENANT_MEMBER])
async def test_anonymous_and_tenant_connections_are_closed(role):
    communicator, connected, code = await _connect(role)
    assert (connected, code) == (False, 4403)


async def _receive_matching(communicator: WebSocketClient, needle: str, *, tries: int = 10) -> str:
    for _ in range(tries):
        html = await communicator.receive_from(timeout=5)
        if needle in html:
            return html
    raise AssertionError(f"no fragment with {needle!r} arrived")


def _polyline(html: str, element_id: str) -> list[str]:
    start = html.index(f'id="{element_id}"')
    return re.search(r'<polyline points="([^"]*)"', html[start:]).group(1).split()


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
async def test_operators_receive_each_heartbeats_figures_with_a_growing_sparkline(role):
    worker = await sync_to_async(make_worker)()
    await sync_to_async(GpuFactory)(worker=worker, index=0)
    communicator, connected, _ = await _connect(role)
    assert connected
    try:
        for utilisation in (20.0, 80.0):
            await sync_to_async(beat)(
                worker,
                gpus=[
                    {
                        "index": 0,
                        "utilization_pct": utilisation,
                        "memory_used_bytes": 10 * 1024**3,
                        "memory_total_bytes": 80 * 1024**3,
                        "temperature_c": 55.0,
                        "power_w": 300.0,
                    }
                ],
            )
            html = await _receive_matching(communicator, f'id="metrics-{worker.pk}-gpu0"')
            assert (
                f'id="figure-{worker.pk}-gpu0-utilization" data-testid="figure-utilization">{utilisation:.0f}%<' in html
            )
            assert f'id="metrics-{worker.pk}-cpu"' in html  # the host's CPU row too
            assert f'id="worker-{worker.pk}-heartbeat"' in html and "last heartbeat" in html
        points = _polyline(html, f"figure-{worker.pk}-gpu0-utilization")
        assert len(points) == 2
        heights = [float(p.split(",")[1]) for p in points]
        assert heights[1] < heights[0]  # 80% is drawn higher (smaller y) than 20%
    finally:
        await communicator.disconnect()


async def test_a_new_page_continues_the_sparklines_from_the_fleets_recent_figures():
    worker = await sync_to_async(make_worker)()
    await sync_to_async(GpuFactory)(worker=worker, index=0)
    for utilisation in (10.0, 20.0):  # before the page opens
        await sync_to_async(beat)(worker, gpus=[{"index": 0, "utilization_pct": utilisation}])
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        await sync_to_async(beat)(worker, gpus=[{"index": 0, "utilization_pct": 30.0}])
        html = await _receive_matching(communicator, f'id="metrics-{worker.pk}-gpu0"')
        assert len(_polyline(html, f"figure-{worker.pk}-gpu0-utilization")) == 3
    finally:
        await communicator.disconnect()


async def test_load_progress_and_replica_changes_reach_the_page():
    worker = await sync_to_async(make_worker)()
    gpu = await sync_to_async(GpuFactory)(worker=worker, index=0)
    deployment = await sync_to_async(DeploymentFactory)(model=await sync_to_async(ModelFactory)(public_name="tiny"))
    replica = await sync_to_async(ReplicaFactory)(deployment=deployment, worker=worker, gpu=gpu)
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        # The worker reports the load under way: the replica moves to loading and its bar moves.
        await sync_to_async(beat)(
            worker,
            gpus=[{"index": 0, "utilization_pct": 5.0}],
            replicas=[{"replica_id": replica.pk, "state": "loading", "load_progress": 0.5}],
        )
        card = await _receive_matching(communicator, f'id="worker-{worker.pk}"')
        assert f'id="replica-{replica.pk}"' in card and 'data-state="loading"' in card
        assert f'id="deployment-{deployment.pk}-status"' in card
        progress = await _receive_matching(communicator, f'id="replica-{replica.pk}-progress"')
        assert 'aria-valuenow="50"' in progress
        await sync_to_async(replica_transition)(
            replica=replica, to_state=Replica.State.READY, at=timezone.now(), endpoint_url="http://127.0.0.1:9100"
        )
        card = await _receive_matching(
            communicator, f'id="replica-{replica.pk}" data-testid="replica" data-state="ready"'
        )
        assert 'data-testid="deployment-status" data-state="ready"' in card
    finally:
        await communicator.disconnect()


async def test_a_new_worker_appears_on_the_page():
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        await sync_to_async(worker_register)(
            registration=parse_registration(
                {
                    "name": "fresh-worker",
                    "advertise_host": "10.0.0.9",
                    "device": "cpu",
                    "gpus": [],
                    "cpu": {"memory_total_bytes": 1 << 34, "cores": 4},
                }
            ),
            now=timezone.now(),
        )
        html = await _receive_matching(communicator, 'data-worker-name="fresh-worker"')
        assert html.lstrip().startswith('<div id="workers"')
    finally:
        await communicator.disconnect()


async def test_replica_load_figures_and_autoscaling_decisions_reach_the_page():
    from controlplane.fleet.services.autoscaling import deployments_autoscale

    worker = await sync_to_async(make_worker)()
    gpu = await sync_to_async(GpuFactory)(worker=worker, index=0)
    deployment = await sync_to_async(DeploymentFactory)(
        model=await sync_to_async(ModelFactory)(public_name="busy"),
        max_replicas=4,
        target_concurrency=2,
        autoscale=True,
        scaled_at=timezone.now() - timedelta(hours=1),
    )
    replica = await sync_to_async(ReplicaFactory)(
        deployment=deployment, worker=worker, gpu=gpu, state=Replica.State.READY, endpoint_url="http://127.0.0.1:9100"
    )
    tenant = await sync_to_async(TenantFactory)(name="acme")
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        await sync_to_async(beat)(
            worker,
            gpus=[{"index": 0, "utilization_pct": 90.0}],
            replicas=[
                {
                    "replica_id": replica.pk,
                    "state": "ready",
                    "endpoint_url": "http://127.0.0.1:9100",
                    "running": 2,
                    "waiting": 4,
                    "kv_cache_usage": 0.5,
                    "tokens_per_s": 80.0,
                    "prefix_cache_hit_rate": 0.6,
                    "host_cache_hit_rate": 0.25,
                    "tenant_shares": {str(tenant.pk): 1.0},
                }
            ],
        )
        html = await _receive_matching(communicator, f'id="replica-{replica.pk}-load"')
        assert "queue 4 · running 2 · KV 50% · 80 tok/s · cache hits 60% (host tier 25%)" in html
        assert "shares: acme 100%" in html
        await sync_to_async(deployments_autoscale)(now=timezone.now())
        html = await _receive_matching(communicator, f'id="deployment-{deployment.pk}-autoscale"')
        # 6 in flight for replicas that should carry 2 × 70% each: the maximum, 4.
        assert 'data-action="up"' in html and "Scaled up · 4" in html and "waiting 4 · running 2" in html
    finally:
        await communicator.disconnect()


async def test_deployment_changes_reach_the_page_with_their_inputs():
    # Another writer (an operator elsewhere, the autoscaler) scales: every open page shows the
    # new count, not the one it was opened with.
    deployment = await sync_to_async(DeploymentFactory)(desired_replicas=1, min_replicas=0, max_replicas=4)
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        await sync_to_async(deployment_scale)(deployment=deployment, desired_replicas=3, actor=None)
        html = await _receive_matching(communicator, f'id="deployment-{deployment.pk}-status"')
        assert 'data-desired="3"' in html and "desired 3 · min 0 · max 4" in html
        # A new deployment joins the list.
        model = await sync_to_async(ModelFactory)(public_name="newcomer")
        await sync_to_async(deployment_create)(model_name=model.public_name, desired_replicas=0, actor=None)
        html = await _receive_matching(communicator, 'data-model="newcomer"')
        assert html.lstrip().startswith('<div id="deployments"')
    finally:
        await communicator.disconnect()


@sync_to_async
def _operator_posts(url: str, data: dict) -> tuple[str, str]:
    """An operator's htmx form post: the answer's body and its HX-Trigger."""
    client = Client()
    client.force_login(make_user(User.Role.OPERATOR))
    response = client.post(url, data, HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    return response.content.decode(), response.get("HX-Trigger", "")


async def _drawn_once(communicator: WebSocketClient, element_id: str) -> str:
    """The one fragment that draws `element_id`; nothing else arrives after it."""
    html = await _receive_matching(communicator, f'id="{element_id}"')
    assert html.count(f'id="{element_id}"') == 1
    assert await communicator.receive_nothing(timeout=1.0), "the page was sent more after the change"
    return html


async def test_each_change_on_the_fleet_page_is_drawn_once_by_the_live_push():
    # The operator's own form posts answer with their form and a line, never with the deployment's
    # status or a worker's card: those reach every page, the operator's included, over the live
    # push alone, so no answer can land after a newer push and draw an older state over it.
    worker = await sync_to_async(make_worker)()
    gpu = await sync_to_async(GpuFactory)(worker=worker, index=0)
    deployment = await sync_to_async(DeploymentFactory)(
        model=await sync_to_async(ModelFactory)(public_name="drawn-once", gpu_memory_bytes=1024),
        desired_replicas=1,
        min_replicas=0,
        max_replicas=2,
    )
    pk, status = deployment.pk, f"deployment-{deployment.pk}-status"
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        answer, trigger = await _operator_posts(
            reverse("dashboard:deployment_edit", args=[pk]),
            {f"d{pk}-desired_replicas": "1", f"d{pk}-min_replicas": "0", f"d{pk}-max_replicas": "3"},
        )
        assert f'id="{status}"' not in answer and "fleet-changed" in trigger
        assert "desired 1 · min 0 · max 3" in await _drawn_once(communicator, status)

        answer, _ = await _operator_posts(
            reverse("dashboard:deployment_scale", args=[pk]), {f"s{pk}-desired_replicas": "2"}
        )
        assert f'id="{status}"' not in answer and "now wants 2 replicas." in answer
        assert 'data-desired="2"' in await _drawn_once(communicator, status)

        # A refused change changes nothing, and nothing is pushed: the answer alone says why.
        answer, trigger = await _operator_posts(
            reverse("dashboard:deployment_scale", args=[pk]), {f"s{pk}-desired_replicas": "9"}
        )
        assert "raise Max replicas to scale to 9" in answer and trigger == ""
        assert await communicator.receive_nothing(timeout=1.0)

        # Loading by hand: the new replica reaches the worker's card over the push, once.
        answer, _ = await _operator_posts(
            reverse("dashboard:replica_load"), {"deployment": pk, "slot": f"{worker.pk}:{gpu.pk}"}
        )
        assert 'data-testid="load-done"' in answer and f'id="worker-{worker.pk}"' not in answer
        card = await _receive_matching(communicator, f'id="worker-{worker.pk}"')
        assert card.count(f'id="worker-{worker.pk}"') == 1 and 'data-testid="replica"' in card
    finally:
        await communicator.disconnect()


async def test_a_failed_load_and_why_a_replica_is_unplaced_reach_the_page(settings):
    settings.FLEET_LOAD_RETRY_INITIAL_SECONDS = 60
    worker = await sync_to_async(make_worker)()
    await sync_to_async(GpuFactory)(worker=worker, index=0, memory_total_bytes=80 * 1024**3)
    deployment = await sync_to_async(DeploymentFactory)(
        model=await sync_to_async(ModelFactory)(gpu_memory_bytes=1024**3), desired_replicas=1, max_replicas=1
    )
    now = timezone.now()
    [replica_id] = (await sync_to_async(deployment_reconcile)(deployment_id=deployment.pk, now=now)).placed
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        await sync_to_async(beat)(
            worker,
            replicas=[
                {
                    "replica_id": replica_id,
                    "state": "failed",
                    "error": "OSError: [Errno 98] address already in use\nTraceback",
                }
            ],
        )
        html = await _receive_matching(communicator, 'data-testid="deployment-error"')
        assert f"{worker.name}: OSError: [Errno 98] address already in use" in html
        assert 'data-testid="retry-now"' in html
        # The next reconcile cannot place it (backing off): the page says why, per GPU.
        await sync_to_async(deployment_reconcile)(deployment_id=deployment.pk, now=now)
        html = await _receive_matching(communicator, "backing off until")
        assert f"needs 1.0 GiB; free: {worker.name} GPU 0 (NVIDIA H200) 80.0 GiB of 80.0 GiB" in html
    finally:
        await communicator.disconnect()


async def test_a_page_that_reconnects_gets_what_it_missed():
    worker = await sync_to_async(make_worker)()
    deployment = await sync_to_async(DeploymentFactory)(desired_replicas=1, min_replicas=0, max_replicas=4)
    communicator, connected, _ = await _connect(User.Role.OPERATOR)
    assert connected
    try:
        await communicator.send_to(text_data="not json")  # ignored, the connection stays
        await communicator.send_to(text_data='{"resync": true}')
        html = await _receive_matching(communicator, 'id="workers"')
        assert html.lstrip().startswith('<div id="workers"') and f'id="worker-{worker.pk}"' in html
        assert f'id="deployment-{deployment.pk}-status"' in html and 'data-desired="1"' in html
    finally:
        await communicator.disconnect()
