"""The fleet server's ASGI app: the daemons' /internal/ API and the health probes, nothing else; a
registration through the public server still works but is logged as a warning."""

import asyncio
import logging

import httpx
import pytest

# Imported once, before any test: building the apps sets Django up, which configures logging anew
# (and would drop the handler caplog adds).
from controlplane.asgi import application as public_application
from controlplane.fleet.models import Worker
from controlplane.fleet_asgi import application

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "fleet-asgi-test-token"
REGISTRATION = {
    "name": "host-fleet-asgi",
    "advertise_host": "127.0.0.1",
    "device": "cpu",
    "gpus": [],
    "cpu": {"memory_total_bytes": 8 * 1024**3, "cores": 4},
    "version": "0.1.0",
}


@pytest.fixture(autouse=True)
def _token(settings):
    settings.FLEET_WORKER_TOKEN = TOKEN


def _requests(app, *calls: tuple[str, str, dict | None]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return [
                await client.request(method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
                for method, path, body in calls
            ]

    return asyncio.run(go())


def test_the_fleet_server_registers_a_worker_and_takes_its_heartbeats(caplog):
    with caplog.at_level(logging.WARNING, logger="controlplane.fleet.views"):
        [registered] = _requests(application, ("POST", "/internal/workers/register", REGISTRATION))
        assert registered.status_code == 200, registered.text
        worker_id = registered.json()["worker_id"]
        heartbeat = {"gpus": [], "replicas": []}
        [beat] = _requests(application, ("POST", f"/internal/workers/{worker_id}/heartbeat", heartbeat))
    assert beat.status_code == 200 and beat.json()["ok"] is True
    assert Worker.objects.get(pk=worker_id).name == "host-fleet-asgi"
    assert "public server" not in caplog.text


@pytest.mark.parametrize("path", ["/", "/v1/models", "/admin/", "/metrics", "/accounts/login/"])
def test_the_fleet_server_answers_nothing_but_the_daemons_api_and_the_probes(path):
    [response] = _requests(application, ("GET", path, None))
    assert response.status_code == 404
    assert "/internal/" in response.json()["error"]


def test_the_fleet_server_answers_the_health_probe():
    [response] = _requests(application, ("GET", "/healthz", None))
    assert response.status_code == 200


def test_a_registration_through_the_public_server_works_and_says_where_to_point_the_daemon(caplog):
    with caplog.at_level(logging.WARNING, logger="controlplane.fleet.views"):
        [registered] = _requests(public_application, ("POST", "/internal/workers/register", REGISTRATION))
    assert registered.status_code == 200, registered.text
    assert "host-fleet-asgi registered through the public server" in caplog.text
    assert "--control-url" in caplog.text and "FLEET_PORT" in caplog.text
