"""Fleet test helpers: a private live-cache namespace per test, uniquely named workers (their Celery
queue names must not meet another test run's on the shared broker), reading those queues, and a
real replica server for the lost-worker judge to ask."""

import uuid

import pytest

from controlplane.celery import app as celery_app
from tests.controlplane.factories import WorkerFactory


@pytest.fixture(autouse=True)
def _private_live_cache(settings):
    # Changing CACHES makes Django drop its cache connections, so the new prefix takes effect.
    settings.CACHES = {**settings.CACHES, "live": {**settings.CACHES["live"], "KEY_PREFIX": f"test-{uuid.uuid4().hex}"}}


def make_worker(**fields):
    return WorkerFactory(name=fields.pop("name", f"test-{uuid.uuid4().hex[:12]}"), **fields)


def queued_tasks(queue: str) -> list[tuple[str, dict]]:
    """Take every message off a worker's queue on the real broker: (task name, kwargs) in order."""
    found = []
    with celery_app.connection_for_read() as connection:
        queue_reader = connection.SimpleQueue(queue, no_ack=True)
        try:
            while True:
                try:
                    message = queue_reader.get(timeout=0.3)
                except queue_reader.Empty:
                    break
                found.append((message.headers["task"], message.payload[1]))
        finally:
            queue_reader.close()
    return found


@pytest.fixture(scope="session")
def replica_server(tmp_path_factory):
    """A real replica server (`python -m gpuworker serve` on CPU, a tiny checkpoint) that answers
    /health as a worker's replica does; it asks for the gateway tests' WORKER_TOKEN."""
    from tests.controlplane.gateway.conftest import start_replica, wait_ready
    from tests.gpuworker.checkpoints import make_checkpoint

    server = start_replica(make_checkpoint(tmp_path_factory.mktemp("fleet-replica"), "llama"), "tiny")
    try:
        wait_ready(server)
        yield server
    finally:
        server.kill()
