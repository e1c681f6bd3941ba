import socket

import pytest


def _closed_port() -> int:
    """A port nobody listens on: the OS hands it out, and it is closed again at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthz_is_liveness_and_asks_nothing_of_the_dependencies(client, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{_closed_port()}/0"
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_is_ready_when_the_database_and_redis_answer(client, settings):
    response = client.get("/readyz")
    assert response.status_code == 200
    expected = {"database": "ok", **({"redis": "ok"} if settings.REDIS_URL else {})}
    assert response.json() == {"status": "ready", "checks": expected}


@pytest.mark.django_db
def test_readyz_names_redis_when_it_does_not_answer(client, settings):
    port = _closed_port()
    settings.REDIS_URL = f"redis://:secret-password@127.0.0.1:{port}/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"] == {"database": "ok", "redis": "unreachable"}
    assert body["status"] == "unavailable" and "redis" in body["message"]
    assert "secret-password" not in response.content.decode() and str(port) not in response.content.decode()
