"""The /internal/ endpoints, through Django's test client (HTTP parsing, auth, status codes)."""

import pytest

from controlplane.fleet.models import Replica, Worker
from tests.controlplane.factories import ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker

pytestmark = pytest.mark.django_db

TOKEN = "fleet-test-token"
REGISTRATION = {
    "name": "host-a",
    "advertise_host": "127.0.0.1",
    "device": "cpu",
    "gpus": [],
    "cpu": {"memory_total_bytes": 8 * 1024**3, "cores": 4},
    "version": "0.1.0",
}


@pytest.fixture(autouse=True)
def _token(settings):
    settings.FLEET_WORKER_TOKEN = TOKEN


def _post(client, path, body, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return client.post(path, body, content_type="application/json", headers=headers)


def test_register_answers_the_queue_and_the_broker(client, settings):
    response = _post(client, "/internal/workers/register", REGISTRATION)
    assert response.status_code == 200
    body = response.json()
    worker = Worker.objects.get(name="host-a")
    assert body["worker_id"] == worker.pk and body["queue"] == "gpuworker.host-a"
    assert body["heartbeat_interval_s"] == 1.0
    assert body["celery"]["broker_url"] == settings.FLEET_WORKER_BROKER_URL
    assert isinstance(body["celery"]["broker_transport_options"], dict)
    # Registering again is idempotent by name.
    assert _post(client, "/internal/workers/register", REGISTRATION).json()["worker_id"] == worker.pk


@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_a_missing_or_wrong_token_is_refused(client, token):
    for path in ("/internal/workers/register", "/internal/workers/1/heartbeat"):
        response = _post(client, path, REGISTRATION, token=token)
        assert response.status_code == 401 and "token" in response.json()["error"]
    assert not Worker.objects.exists()


def test_bad_bodies_get_400_naming_the_field(client):
    response = _post(client, "/internal/workers/register", {**REGISTRATION, "device": "tpu"})
    assert response.status_code == 400 and "device" in response.json()["fields"]
    response = client.post(
        "/internal/workers/register",
        "{not json",
        content_type="application/json",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert response.status_code == 400 and response.json()["error"] == "The body must be JSON."
    response = client.get("/internal/workers/register", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 405


def test_heartbeat_answers_ok_and_what_to_unload(client):
    worker = make_worker()
    ready = ReplicaFactory(worker=worker, state=Replica.State.LOADING)
    replicas = [
        {"replica_id": ready.pk, "state": "ready", "endpoint_url": "http://127.0.0.1:8101", "load_progress": 1.0},
        {"replica_id": 424242, "state": "ready", "endpoint_url": "http://127.0.0.1:8102"},
    ]
    response = _post(
        client,
        f"/internal/workers/{worker.pk}/heartbeat",
        {"sent_at": "2026-01-01T00:00:00+00:00", "draining": False, "replicas": replicas},
    )
    assert response.status_code == 200 and response.json() == {"ok": True, "unload": [424242]}
    ready.refresh_from_db()
    assert ready.state == Replica.State.READY
    response = _post(client, f"/internal/workers/{worker.pk}/heartbeat", {"replicas": replicas[:1]})
    assert response.json() == {"ok": True}


def test_heartbeat_of_an_unknown_worker_is_404(client):
    response = _post(client, "/internal/workers/999999/heartbeat", {"replicas": []})
    assert response.status_code == 404 and "register again" in response.json()["error"]


def test_a_heartbeat_while_the_control_planes_redis_is_unreachable_is_a_503_to_retry(client, settings):
    """The daemon beats again in a second; a 500 (a traceback and Django's error page) would be noise."""
    import socket

    worker_id = _post(client, "/internal/workers/register", REGISTRATION).json()["worker_id"]
    with socket.socket() as probe:  # a port nothing listens on: Redis is down
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings.CACHES = {
        **settings.CACHES,
        "live": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": f"redis://127.0.0.1:{port}/0"},
    }
    response = _post(
        client,
        f"/internal/workers/{worker_id}/heartbeat",
        {"sent_at": "2026-12-01T00:00:00+00:00", "draining": False, "gpus": [], "cpu": {}, "replicas": []},
    )
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json() == {"error": "The control plane cannot reach its redis right now."}
