"""Helpers for the operator-page tests: users by role, a private live cache per test, uniquely
named workers (their Celery queues must not meet another run's on the shared broker), and a
worker's latest heartbeat stored through the real heartbeat service."""

import uuid

import pytest
from asgiref.testing import ApplicationCommunicator
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.fleet.reports import parse_heartbeat
from controlplane.fleet.services import worker_heartbeat
from tests.controlplane.factories import TenantFactory, UserFactory, WorkerFactory


@pytest.fixture(autouse=True)
def _private_live_cache(settings):
    settings.CACHES = {**settings.CACHES, "live": {**settings.CACHES["live"], "KEY_PREFIX": f"test-{uuid.uuid4().hex}"}}


def make_user(role: str) -> User:
    tenant = TenantFactory() if role == User.Role.TENANT_MEMBER else None
    return UserFactory(role=role, tenant=tenant)


@pytest.fixture
def operator() -> User:
    return make_user(User.Role.OPERATOR)


@pytest.fixture
def operator_client(client, operator):
    client.force_login(operator)
    return client


def make_worker(**fields):
    return WorkerFactory(name=fields.pop("name", f"test-{uuid.uuid4().hex[:12]}"), **fields)


def beat(worker, *, gpus=(), cpu=None, replicas=()) -> None:
    """One heartbeat through the service the /internal/ endpoint calls."""
    body = {"gpus": list(gpus), "cpu": cpu or {"utilization_pct": 5.0, "memory_used_bytes": 1 << 30,
                                                "memory_total_bytes": 8 << 30},
            "replicas": list(replicas)}
    worker_heartbeat(worker_id=worker.pk, heartbeat=parse_heartbeat(body), now=timezone.now())


class WebSocketClient(ApplicationCommunicator):
    """channels.testing.WebsocketCommunicator's connect/receive/disconnect, on asgiref's
    ApplicationCommunicator: importing channels.testing needs daphne, which this project does not
    install (uvicorn serves it)."""

    def __init__(self, application, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(application, {"type": "websocket", "path": path, "query_string": b"",
                                       "headers": headers, "subprotocols": []})

    async def connect(self, timeout: float = 5) -> tuple[bool, int | None]:
        await self.send_input({"type": "websocket.connect"})
        response = await self.receive_output(timeout)
        if response["type"] == "websocket.close":
            return False, response.get("code", 1000)
        assert response["type"] == "websocket.accept", response
        return True, None

    async def receive_from(self, timeout: float = 5) -> str:
        response = await self.receive_output(timeout)
        assert response["type"] == "websocket.send" and "text" in response, response
        return response["text"]

    async def disconnect(self, code: int = 1000, timeout: float = 5) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": code})
        await self.wait(timeout)
