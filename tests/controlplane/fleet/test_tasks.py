"""Fleet tasks run by a real Celery worker consuming from the real broker (Redis in CI)."""

import uuid
from datetime import timedelta

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun
from django.db import connection
from django.utils import timezone

from controlplane.celery import app as celery_app
from controlplane.fleet.models import Worker
from controlplane.fleet.tasks import mark_stale_workers
from tests.controlplane.factories import WorkerFactory


def _close_worker_connection(**kwargs):
    # The embedded worker runs tasks in its own thread, with its own connection: close it so the
    # test database can be dropped at the end of the session.
    connection.close()


@pytest.mark.django_db(transaction=True)
def test_beat_task_marks_silent_workers_offline_through_the_broker(redis_url, settings):
    settings.FLEET_WORKER_HEARTBEAT_TIMEOUT_SECONDS = 30
    now = timezone.now()
    silent = WorkerFactory(last_heartbeat_at=now - timedelta(minutes=5))
    alive = WorkerFactory(last_heartbeat_at=now)
    # A queue of its own, so a concurrently running `make run` or test session cannot take the task.
    queue = f"test-{uuid.uuid4().hex}"
    task_postrun.connect(_close_worker_connection, weak=False)
    try:
        with start_worker(celery_app, queues=[queue], perform_ping_check=False, loglevel="WARNING"):
            assert mark_stale_workers.apply_async(queue=queue).get(timeout=20) == 1
    finally:
        task_postrun.disconnect(_close_worker_connection)
    silent.refresh_from_db(), alive.refresh_from_db()
    assert (silent.state, alive.state) == (Worker.State.OFFLINE, Worker.State.ONLINE)
