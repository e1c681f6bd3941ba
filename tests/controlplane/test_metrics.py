"""`GET /metrics`: who may read it, the fleet's gauges read from the database at scrape time, and
the gateway's figures summed over several processes' files (PROMETHEUS_MULTIPROC_DIR). The
figures after real gateway requests are in tests/controlplane/gateway/test_metrics.py."""

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from controlplane import metrics
from controlplane.accounts.models import User
from controlplane.fleet import heartbeat_cache
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.services.heartbeats import workers_mark_lost
from tests.controlplane.dashboard.ops_support import _private_live_cache, make_user  # noqa: F401 (fixture)
from tests.controlplane.factories import DeploymentFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parents[2]
TOKEN = "scraper-secret"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def token(settings):
    settings.METRICS_TOKEN = TOKEN
    return TOKEN


def test_without_a_login_or_token_it_is_401(client, token):
    response = client.get(reverse("metrics"))
    assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
    assert "METRICS_TOKEN" in response.content.decode()


@pytest.mark.parametrize("authorization", [f"Bearer {TOKEN}x", "Bearer ", f"Basic {TOKEN}", "garbage"])
def test_a_wrong_token_is_401(client, token, authorization):
    assert client.get(reverse("metrics"), HTTP_AUTHORIZATION=authorization).status_code == 401


def test_no_token_is_accepted_while_none_is_configured(client, settings):
    settings.METRICS_TOKEN = ""
    assert client.get(reverse("metrics"), HTTP_AUTHORIZATION="Bearer ").status_code == 401


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.TENANT_MEMBER])
def test_other_roles_get_403(client, token, role):
    client.force_login(make_user(role))
    assert client.get(reverse("metrics")).status_code == 403


def test_the_token_or_an_admin_login_opens_it(client, token):
    by_token = client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert by_token.status_code == 200 and by_token["Content-Type"].startswith("text/plain; version=")
    client.force_login(make_user(User.Role.ADMIN))
    assert client.get(reverse("metrics")).status_code == 200
    assert client.post(reverse("metrics")).status_code == 405


def test_fleet_gauges_are_read_from_the_database(client, token):
    deployment = DeploymentFactory(desired_replicas=3, max_replicas=4)
    name = deployment.model.public_name
    worker = make_worker(name="gpu-a", state_changed_at=timezone.now() - timedelta(minutes=5))
    ReplicaFactory.create_batch(2, deployment=deployment, worker=worker, state=Replica.State.READY)
    ReplicaFactory(deployment=deployment, worker=worker, state=Replica.State.LOADING)
    ReplicaFactory(deployment=deployment, worker=worker, state=Replica.State.STOPPED)  # history, not counted
    heartbeat_cache.store(
        worker_id=worker.pk, state={"received_at": (timezone.now() - timedelta(seconds=7)).timestamp()}
    )
    make_worker(name="gpu-b", state=Worker.State.LOST, state_changed_at=timezone.now() - timedelta(seconds=40))
    make_worker(name="gpu-c", state=Worker.State.OFFLINE)

    samples = _samples(client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode())
    assert samples[("gpuserve_replicas", (("model", name), ("state", "ready")))] == 2
    assert samples[("gpuserve_replicas", (("model", name), ("state", "loading")))] == 1
    assert samples[("gpuserve_replicas", (("model", name), ("state", "draining")))] == 0
    assert ("gpuserve_replicas", (("model", name), ("state", "stopped"))) not in samples
    assert samples[("gpuserve_deployment_desired_replicas", (("model", name),))] == 3
    assert samples[("gpuserve_workers", (("state", "online"),))] == 1
    assert samples[("gpuserve_workers", (("state", "lost"),))] == 1
    assert 7 <= samples[("gpuserve_worker_heartbeat_age_seconds", (("worker", "gpu-a"),))] < 60
    # Never heard from since it was lost: counted from that change.
    assert samples[("gpuserve_worker_heartbeat_age_seconds", (("worker", "gpu-b"),))] >= 40
    assert ("gpuserve_worker_heartbeat_age_seconds", (("worker", "gpu-c"),)) not in samples


def _paused(client) -> tuple[set[str], float | None]:
    """The reasons the lost-worker judgement is paused for, and its last check's time."""
    samples = _samples(client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode())
    reasons = {
        dict(labels)["reason"]
        for (name, labels), value in samples.items()
        if name == "gpuserve_fleet_lost_judgement_paused" and value == 1
    }
    return reasons, samples.get(("gpuserve_fleet_lost_check_timestamp_seconds", ()))


def test_the_lost_worker_judgement_says_when_it_is_paused(client, token, settings):
    settings.FLEET_WORKER_LOST_AFTER_SECONDS = 3
    assert _paused(client) == ({"check_not_running"}, None)
    now = timezone.now()
    for seconds in range(60, 49, -1):  # a minute ago, ten checks; none since (the database was down, say)
        workers_mark_lost(now=now - timedelta(seconds=seconds))
    assert _paused(client) == ({"check_not_running"}, (now - timedelta(seconds=50)).timestamp())
    workers_mark_lost(now=now)  # back: a whole lost window must pass before anyone is judged
    assert _paused(client) == ({"watch_resumed"}, now.timestamp())


def test_the_lost_worker_judgement_is_not_paused_after_a_lost_window_of_checks(client, token, settings):
    settings.FLEET_WORKER_LOST_AFTER_SECONDS = 3
    now = timezone.now()
    for seconds in range(10, -1, -1):
        workers_mark_lost(now=now - timedelta(seconds=seconds))
    assert _paused(client) == (set(), now.timestamp())


_RECORD = """
import time
from controlplane.gateway import metrics
metrics.request_finished(model="m", endpoint="/v1/chat/completions", outcome="completed", status=200,
                         started=time.monotonic() - 0.3, first_token_at=time.monotonic() - 0.2)
metrics.credits_charged(model="m", amount="0.002")
"""


def test_figures_of_several_gateway_processes_are_summed(monkeypatch, tmp_path):
    # Two processes record, as two uvicorn workers would; this one only reads their files.
    for _ in range(2):
        subprocess.run(
            [sys.executable, "-c", _RECORD],
            cwd=REPO,
            check=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
        )
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    samples = _samples(metrics.render().decode())
    assert (
        samples[
            (
                "gpuserve_gateway_requests_total",
                (("endpoint", "/v1/chat/completions"), ("model", "m"), ("outcome", "completed"), ("status", "200")),
            )
        ]
        == 2
    )
    assert samples[("gpuserve_gateway_request_duration_seconds_count", (("model", "m"),))] == 2
    assert samples[("gpuserve_gateway_time_to_first_token_seconds_count", (("model", "m"),))] == 2
    assert samples[("gpuserve_credits_charged_total", (("model", "m"),))] == pytest.approx(0.004)


@pytest.mark.django_db(transaction=True)
def test_with_the_database_down_it_still_answers_and_says_so(client, token):
    from django.db import connection

    from tests.controlplane.gateway.conftest import free_port

    saved = dict(connection.settings_dict)
    connection.close()
    # A port nothing listens on: every query fails to connect, as with PostgreSQL stopped.
    connection.settings_dict.update(HOST="127.0.0.1", PORT=str(free_port()))
    try:
        response = client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)
    assert response.status_code == 200
    samples = _samples(response.content.decode())
    assert samples[("gpuserve_fleet_metrics_up", ())] == 0
    assert not any(name.startswith("gpuserve_replicas") for name, _ in samples)
    # Read from the cache alone: no lost-worker check has completed (none could, without the database).
    assert samples[("gpuserve_fleet_lost_judgement_paused", (("reason", "check_not_running"),))] == 1
    # Reachable again, the figures come back.
    samples = _samples(client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode())
    assert samples[("gpuserve_fleet_metrics_up", ())] == 1
