"""Fleet tasks run by a real Celery worker consuming from the real broker (Redis in CI)."""

import logging
import socket
import uuid
from datetime import timedelta

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun
from django.db import connection
from django.utils import timezone

from controlplane.celery import app as celery_app
from controlplane.fleet import heartbeat_cache
from controlplane.fleet.lost_watch import Watch
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.services.deployments import deployment_scale
from controlplane.fleet.tasks import mark_lost_workers, reconcile
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker, queued_tasks


def _close_worker_connection(**kwargs):
    # The embedded worker runs tasks in its own thread, with its own connection: close it so the
    # test database can be dropped at the end of the session.
    connection.close()


@pytest.fixture
def celery_queue(redis_url):
    """A Celery worker in this process on a queue of its own, so a concurrently running `make run`
    or test session cannot take the tasks."""
    queue = f"test-{uuid.uuid4().hex}"
    task_postrun.connect(_close_worker_connection, weak=False)
    try:
        with start_worker(celery_app, queues=[queue], perform_ping_check=False, loglevel="WARNING"):
            yield queue
    finally:
        task_postrun.disconnect(_close_worker_connection)


@pytest.mark.django_db(transaction=True)
def test_beat_task_marks_silent_workers_lost_through_the_broker(celery_queue, settings):
    # The judge has watched for a minute; the task may come a while after this check on a busy machine.
    settings.FLEET_WORKER_LOST_AFTER_SECONDS = 30
    now = timezone.now()
    heartbeat_cache.store_lost_watch(watch=Watch(since=now.timestamp() - 60, checked_at=now.timestamp()).to_json())
    silent = make_worker(state_changed_at=now - timedelta(minutes=5))
    replica = ReplicaFactory(worker=silent, state=Replica.State.READY, endpoint_url="http://w:1")
    alive = make_worker()
    assert mark_lost_workers.apply_async(queue=celery_queue).get(timeout=20) == 1
    silent.refresh_from_db(), alive.refresh_from_db(), replica.refresh_from_db()
    assert (silent.state, alive.state, replica.state) == (Worker.State.LOST, Worker.State.ONLINE, Replica.State.FAILED)


@pytest.mark.django_db(transaction=True)
def test_reconcile_task_places_and_the_worker_gets_its_load_message(celery_queue):
    gpu = GpuFactory(worker=make_worker(), index=0)
    deployment = DeploymentFactory(desired_replicas=1)
    result = reconcile.apply_async(kwargs={"deployment_ids": [deployment.pk]}, queue=celery_queue).get(timeout=20)
    assert result == {"placed": 1, "removed": 0, "unplaced": 0}
    [(name, kwargs)] = queued_tasks(gpu.worker.queue_name)
    assert (name, kwargs["replica_id"]) == ("gpuworker.load_model", Replica.objects.get().pk)


@pytest.mark.django_db
def test_scaling_a_deployment_requests_a_reconcile_after_commit(redis_url, django_capture_on_commit_callbacks):
    deployment = DeploymentFactory(desired_replicas=0, max_replicas=2)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        deployment_scale(deployment=deployment, desired_replicas=2, actor=None)
    assert len(callbacks) == 2  # nothing is sent before the commit: the page's event, the reconcile request
    for callback in callbacks:
        callback()
    # The control plane's own Celery workers consume the default queue.
    requests = [
        kwargs
        for name, kwargs in queued_tasks(celery_app.conf.task_default_queue)
        if name == "controlplane.fleet.tasks.reconcile"
    ]
    assert {"deployment_ids": [deployment.pk]} in requests


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.django_db
def test_the_check_pauses_and_says_so_while_redis_is_unreachable(settings, caplog):
    make_worker(state_changed_at=timezone.now() - timedelta(minutes=5))
    settings.CACHES = {
        **settings.CACHES,
        "live": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{_closed_port()}/0",
        },
    }
    with caplog.at_level(logging.WARNING, logger="controlplane.fleet.tasks"):
        assert mark_lost_workers() == 0
    assert "lost-worker judgement paused: the redis is unreachable (ConnectionError)" in caplog.text
    assert set(Worker.objects.values_list("state", flat=True)) == {Worker.State.ONLINE}


@pytest.mark.django_db(transaction=True)
def test_the_check_pauses_and_says_so_while_the_database_is_unreachable(caplog):
    port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = _closed_port()
    try:
        with caplog.at_level(logging.WARNING, logger="controlplane.fleet.tasks"):
            assert mark_lost_workers() == 0
    finally:
        connection.close()
        connection.settings_dict["PORT"] = port
    assert "lost-worker judgement paused: the database is unreachable (OperationalError)" in caplog.text
