"""The fleet page's actions through the real services: each changes the desired state, sends its
Celery message to the worker's own queue on the real broker, lands in the audit log, and answers
htmx with only what is its own: its form (errors beside the field that caused them) or a line
saying what was done. The change itself reaches the page's live parts over the live push
(test_ops_consumer.py); the answer says fleet-changed, for a page whose WebSocket is down."""

import re

import pytest
from django.urls import reverse

from controlplane.audit.models import AuditEntry
from controlplane.fleet.models import Replica, Worker
from gpuworker.contract.tasks import DRAIN_WORKER, LOAD_MODEL, UNLOAD_MODEL
from tests.controlplane.dashboard.ops_support import (  # noqa: F401 (fixtures)
    _private_live_cache,
    make_worker,
)
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import queued_tasks

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def _says_fleet_changed(response) -> bool:
    return "fleet-changed" in response.get("HX-Trigger", "")


def _audit(action: str) -> AuditEntry:
    return AuditEntry.objects.get(action=action)


def test_scaling_updates_the_deployment_and_is_audited(operator_client, operator, django_capture_on_commit_callbacks):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=3)
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(
            reverse("dashboard:deployment_scale", args=[deployment.pk]),
            {f"s{deployment.pk}-desired_replicas": "3"},
            **HTMX,
        )
    assert response.status_code == 200
    fragment = response.content.decode()
    # The scale form's own answer: the form, filled with the new count, and what was done; the
    # deployment's status is the live push's alone.
    assert fragment.lstrip().startswith(f'<form class="inline-form" id="deployment-{deployment.pk}-scale"')
    assert f'name="s{deployment.pk}-desired_replicas" value="3"' in fragment
    assert 'data-testid="scale-done"' in fragment and "now wants 3 replicas." in fragment
    assert f'id="deployment-{deployment.pk}-status"' not in fragment and "desired 3 · min 0" not in fragment
    assert _says_fleet_changed(response)
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 3
    entry = _audit("deployment.scale")
    assert (entry.actor, entry.detail) == (operator, {"desired_replicas": [1, 3]})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("5", "This deployment allows 0 to 3 replicas; raise Max replicas to scale to 5."),
        ("-1", "Ensure this value is greater than or equal to 0."),
        ("two", "Enter a whole number."),
    ],
)
def test_a_bad_scale_is_refused_beside_the_field(operator_client, value, message):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=3)
    response = operator_client.post(
        reverse("dashboard:deployment_scale", args=[deployment.pk]),
        {f"s{deployment.pk}-desired_replicas": value},
        **HTMX,
    )
    fragment = response.content.decode()
    assert response.status_code == 200 and not _says_fleet_changed(response)
    errors_at = fragment.index(f'id="errors-s{deployment.pk}-desired_replicas"')
    assert fragment.index(f'name="s{deployment.pk}-desired_replicas"') < errors_at
    assert message in fragment[errors_at:]
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 1
    assert not AuditEntry.objects.exists()


@pytest.mark.parametrize(
    ("bounds", "value", "fix", "filled"),
    [
        ((0, 1), 2, "raise Max replicas to scale to 2", {"min_replicas": 0, "max_replicas": 2}),
        ((2, 4), 1, "lower Min replicas to scale to 1", {"min_replicas": 1, "max_replicas": 4}),
    ],
)
def test_a_scale_outside_min_and_max_opens_the_limits_filled_in_to_allow_it(
    operator_client, bounds, value, fix, filled
):
    low, high = bounds
    deployment = DeploymentFactory(desired_replicas=low or 1, min_replicas=low, max_replicas=high)
    p = f"d{deployment.pk}-"
    fragment = operator_client.post(
        reverse("dashboard:deployment_scale", args=[deployment.pk]),
        {f"s{deployment.pk}-desired_replicas": str(value)},
        **HTMX,
    ).content.decode()
    assert f"This deployment allows {low} to {high} replicas; {fix}." in fragment
    # The limits come along out of band, opened.
    assert f'<div class="deployment-limits" id="deployment-{deployment.pk}-limits" hx-swap-oob="true">' in fragment
    assert "<details open>" in fragment
    for name, expected in {"desired_replicas": value, **filled}.items():
        assert f'name="{p}{name}" value="{expected}"' in fragment
    # The form as filled in is one Save away from the scale that was asked for.
    saved = operator_client.post(
        reverse("dashboard:deployment_edit", args=[deployment.pk]),
        {p + "desired_replicas": str(value), **{p + k: str(v) for k, v in filled.items()}},
        **HTMX,
    )
    assert saved.status_code == 200
    deployment.refresh_from_db()
    assert (deployment.desired_replicas, deployment.min_replicas, deployment.max_replicas) == (
        value,
        filled["min_replicas"],
        filled["max_replicas"],
    )


def test_a_malformed_scale_leaves_the_limits_as_they_are(operator_client):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=1)
    fragment = operator_client.post(
        reverse("dashboard:deployment_scale", args=[deployment.pk]),
        {f"s{deployment.pk}-desired_replicas": "two"},
        **HTMX,
    ).content.decode()
    assert "Enter a whole number." in fragment
    assert f'id="deployment-{deployment.pk}-limits"' not in fragment and "<details" not in fragment


def test_editing_min_max_and_keep_warm(operator_client, operator):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=2, keep_warm=False)
    url, p = reverse("dashboard:deployment_edit", args=[deployment.pk]), f"d{deployment.pk}-"
    refused = operator_client.post(
        url, {p + "desired_replicas": "1", p + "min_replicas": "3", p + "max_replicas": "2"}, **HTMX
    ).content.decode()
    assert (
        "Min replicas (3) cannot exceed max replicas (2)." in refused[refused.index(f'id="errors-{p}min_replicas"') :]
    )
    assert "<details open>" in refused  # the form stays open on its errors
    refused = operator_client.post(
        url, {p + "desired_replicas": "5", p + "min_replicas": "0", p + "max_replicas": "4"}, **HTMX
    ).content.decode()
    assert "Desired replicas must lie between min (0) and max (4); got 5." in refused
    assert not AuditEntry.objects.exists()

    response = operator_client.post(
        url,
        {p + "desired_replicas": "2", p + "min_replicas": "1", p + "max_replicas": "4", p + "keep_warm": "on"},
        **HTMX,
    )
    # The limits form's own answer: closed, filled with what was saved, and what was done.
    saved = response.content.decode()
    assert saved.lstrip().startswith(f'<div class="deployment-limits" id="deployment-{deployment.pk}-limits">')
    assert "<details>" in saved and 'data-testid="limits-done"' in saved and "updated." in saved
    for name, value in {"desired_replicas": 2, "min_replicas": 1, "max_replicas": 4}.items():
        assert f'name="{p}{name}" value="{value}"' in saved
    assert re.search(f'<input type="checkbox" name="{p}keep_warm"[^>]* checked>', saved)
    assert f'id="deployment-{deployment.pk}-status"' not in saved and _says_fleet_changed(response)
    deployment.refresh_from_db()
    assert (deployment.desired_replicas, deployment.min_replicas, deployment.max_replicas, deployment.keep_warm) == (
        2,
        1,
        4,
        True,
    )
    assert _audit("deployment.update").detail == {
        "desired_replicas": [1, 2],
        "min_replicas": [0, 1],
        "max_replicas": [2, 4],
        "keep_warm": [False, True],
    }


def test_editing_autoscaling_shows_each_bad_value_beside_its_field(operator_client, operator):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=2, autoscale=True)
    url, p = reverse("dashboard:deployment_edit", args=[deployment.pk]), f"d{deployment.pk}-"
    base = {p + "desired_replicas": "1", p + "min_replicas": "0", p + "max_replicas": "2", p + "autoscale": "on"}
    refused = operator_client.post(
        url, {**base, p + "target_concurrency": "0", p + "ttft_slo_ms": "900000"}, **HTMX
    ).content.decode()
    assert "Must lie between 1 and 1,024; got 0." in refused[refused.index(f'id="errors-{p}target_concurrency"') :]
    assert "Must lie between 1 and 600,000; got 900,000." in refused[refused.index(f'id="errors-{p}ttft_slo_ms"') :]
    assert not AuditEntry.objects.exists()
    operator_client.post(
        url, {**base, p + "autoscale": "", p + "target_concurrency": "12", p + "idle_to_zero_seconds": "0"}, **HTMX
    )
    deployment.refresh_from_db()
    assert (deployment.autoscale, deployment.target_concurrency, deployment.idle_to_zero_seconds) == (False, 12, 0)
    assert _audit("deployment.update").detail["autoscale"] == [True, False]


def test_a_quality_bar_set_in_the_limits_form_refuses_a_scale_with_its_reason(operator_client, operator):
    deployment = DeploymentFactory(
        desired_replicas=0,
        min_replicas=0,
        max_replicas=2,
        model=ModelFactory(public_name="tiny-fp8", quantization="fp8"),
    )
    url, p = reverse("dashboard:deployment_edit", args=[deployment.pk]), f"d{deployment.pk}-"
    base = {p + "desired_replicas": "0", p + "min_replicas": "0", p + "max_replicas": "2"}
    refused = operator_client.post(url, {**base, p + "max_perplexity_increase": "-1"}, **HTMX).content.decode()
    assert "Must be a fraction from 0 to 10, not -1.0." in refused
    operator_client.post(url, {**base, p + "max_perplexity_increase": "0.02"}, **HTMX)
    deployment.refresh_from_db()
    assert deployment.max_perplexity_increase == 0.02
    assert _audit("deployment.update").detail == {"max_perplexity_increase": [None, 0.02]}
    fragment = operator_client.post(
        reverse("dashboard:deployment_scale", args=[deployment.pk]), {f"s{deployment.pk}-desired_replicas": "1"}, **HTMX
    ).content.decode()
    assert "tiny-fp8 must have its perplexity measured before it serves" in fragment
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 0
    # Emptied, the bar is gone and the scale goes through.
    operator_client.post(url, {**base, p + "max_perplexity_increase": ""}, **HTMX)
    operator_client.post(
        reverse("dashboard:deployment_scale", args=[deployment.pk]), {f"s{deployment.pk}-desired_replicas": "1"}, **HTMX
    )
    deployment.refresh_from_db()
    assert (deployment.max_perplexity_increase, deployment.desired_replicas) == (None, 1)


def test_loading_on_a_gpu_sends_the_load_message_to_that_worker(
    operator_client, operator, django_capture_on_commit_callbacks
):
    gpu = GpuFactory(worker=make_worker(), index=1)
    deployment = DeploymentFactory(
        desired_replicas=0, max_replicas=2, model=ModelFactory(public_name="tiny-chat", weights_path="/models/tiny")
    )
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(
            reverse("dashboard:replica_load"),
            {"deployment": deployment.pk, "slot": f"{gpu.worker_id}:{gpu.pk}"},
            **HTMX,
        )
    replica = Replica.objects.get(deployment=deployment)
    assert (replica.worker_id, replica.gpu_id, replica.state) == (gpu.worker_id, gpu.pk, Replica.State.PENDING)
    fragment = response.content.decode()
    assert 'data-testid="load-done"' in fragment and f"(replica {replica.pk})" in fragment
    # The new replica reaches the worker's card over the live push, not in this answer.
    assert f'id="worker-{gpu.worker_id}"' not in fragment and f'id="replica-{replica.pk}"' not in fragment
    assert _says_fleet_changed(response)
    ((task, kwargs),) = queued_tasks(gpu.worker.queue_name)
    assert task == LOAD_MODEL
    assert (kwargs["replica_id"], kwargs["model_path"], kwargs["gpu_index"]) == (replica.pk, "/models/tiny", 1)
    entry = _audit("replica.load")
    assert (entry.actor, entry.target_id) == (operator, str(replica.pk))


def test_loading_where_there_is_no_room_is_refused_beside_the_gpu_choice(operator_client):
    gpu = GpuFactory(worker=make_worker(), index=0, memory_total_bytes=1000)
    deployment = DeploymentFactory(desired_replicas=0, max_replicas=2, model=ModelFactory(gpu_memory_bytes=5000))
    fragment = operator_client.post(
        reverse("dashboard:replica_load"), {"deployment": deployment.pk, "slot": f"{gpu.worker_id}:{gpu.pk}"}, **HTMX
    ).content.decode()
    assert "needs 4.9 KiB; free: " in fragment[fragment.index('id="errors-slot"') :]
    assert f"GPU 0 ({gpu.name}) 1000 B of 1000 B" in fragment
    fragment = operator_client.post(
        reverse("dashboard:replica_load"), {"deployment": "", "slot": ""}, **HTMX
    ).content.decode()
    assert 'id="errors-deployment"' in fragment and 'id="errors-slot"' in fragment
    assert not Replica.objects.exists() and not AuditEntry.objects.exists()


def test_unloading_a_replica_after_confirmation(operator_client, operator, django_capture_on_commit_callbacks):
    worker = make_worker()
    replica = ReplicaFactory(
        worker=worker,
        state=Replica.State.READY,
        endpoint_url="http://127.0.0.1:9100",
        deployment=DeploymentFactory(desired_replicas=1, min_replicas=0),
    )
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    assert f'hx-post="{reverse("dashboard:replica_unload", args=[replica.pk])}"' in page
    assert 'hx-confirm="Unload ' in page  # a destructive action asks first
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(reverse("dashboard:replica_unload", args=[replica.pk]), **HTMX)
    replica.refresh_from_db()
    assert replica.state == Replica.State.DRAINING
    fragment = response.content.decode()
    # The workers' answer line says what was done; the card shows it over the live push.
    assert fragment.lstrip().startswith('<div class="action-answer" id="workers-answer"')
    assert f"Unloading replica {replica.pk} of " in fragment and f'id="worker-{worker.pk}"' not in fragment
    assert _says_fleet_changed(response)
    assert [task for task, _ in queued_tasks(worker.queue_name)] == [UNLOAD_MODEL]
    assert _audit("replica.unload").actor == operator


def test_unloading_below_min_replicas_says_why_beside_the_workers(operator_client):
    replica = ReplicaFactory(
        worker=make_worker(),
        state=Replica.State.READY,
        endpoint_url="http://127.0.0.1:9100",
        deployment=DeploymentFactory(desired_replicas=1, min_replicas=1),
    )
    response = operator_client.post(reverse("dashboard:replica_unload", args=[replica.pk]), **HTMX)
    fragment = response.content.decode()
    assert fragment.lstrip().startswith('<div class="action-answer" id="workers-answer"')
    assert 'data-testid="action-error"' in fragment and "must keep at least 1 replicas" in fragment
    assert not _says_fleet_changed(response)  # nothing changed
    replica.refresh_from_db()
    assert replica.state == Replica.State.READY


def test_draining_a_worker(operator_client, operator, django_capture_on_commit_callbacks):
    worker = make_worker()
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    assert f'hx-confirm="Drain {worker.name}?' in page
    with django_capture_on_commit_callbacks(execute=True):
        fragment = operator_client.post(reverse("dashboard:worker_drain", args=[worker.pk]), **HTMX).content.decode()
    assert f"Draining {worker.name}." in fragment and f'id="worker-{worker.pk}"' not in fragment
    worker.refresh_from_db()
    assert worker.state == Worker.State.DRAINING
    assert [task for task, _ in queued_tasks(worker.queue_name)] == [DRAIN_WORKER]
    assert _audit("worker.drain").actor == operator
    again = operator_client.post(reverse("dashboard:worker_drain", args=[worker.pk]), **HTMX).content.decode()
    assert "only an online worker can be drained" in again


def test_without_htmx_an_action_redirects_back_with_a_message(operator_client):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=3)
    response = operator_client.post(
        reverse("dashboard:deployment_scale", args=[deployment.pk]),
        {f"s{deployment.pk}-desired_replicas": "2"},
        follow=True,
    )
    assert response.redirect_chain[-1][0] == reverse("dashboard:fleet")
    assert "now wants 2 replicas" in response.content.decode()
    response = operator_client.post(
        reverse("dashboard:deployment_scale", args=[deployment.pk]),
        {f"s{deployment.pk}-desired_replicas": "9"},
        follow=True,
    )
    assert "This deployment allows 0 to 3 replicas; raise Max replicas to scale to 9." in response.content.decode()


def _degraded(settings, *, cause: str):
    """A deployment whose only worker failed its load three times in a row (through the services)."""
    from django.utils import timezone

    from controlplane.fleet.reconcile import deployment_reconcile
    from controlplane.fleet.services.heartbeats import worker_heartbeat
    from gpuworker.contract.heartbeat import parse_heartbeat

    settings.FLEET_LOAD_DEGRADED_AFTER_FAILURES = 3
    worker = GpuFactory(worker=make_worker(), index=0).worker
    deployment = DeploymentFactory(model=ModelFactory(gpu_memory_bytes=1024), desired_replicas=1, max_replicas=2)
    at = timezone.now()
    for _ in range(3):
        [replica_id] = deployment_reconcile(deployment_id=deployment.pk, now=at).placed
        worker_heartbeat(
            worker_id=worker.pk,
            now=at,
            heartbeat=parse_heartbeat(
                {
                    "replicas": [
                        {
                            "replica_id": replica_id,
                            "state": "failed",
                            "error": f"{cause}\nTraceback (most recent call last): ...",
                        }
                    ]
                }
            ),
        )
        at = deployment.load_backoffs.get().next_attempt_at
    return deployment, worker


LONG_CAUSE = (
    "FileNotFoundError: no checkpoint at /models/llama-3-8b (looked for config.json and *.safetensors; "
    "the disk holding /models may not be mounted yet on this host)"
)


def test_a_degraded_deployment_shows_its_cause_in_full_and_retry_now_clears_it(
    operator_client, operator, settings, django_capture_on_commit_callbacks
):
    deployment, worker = _degraded(settings, cause=LONG_CAUSE)
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    status = page[page.index(f'id="deployment-{deployment.pk}-status"') :]
    assert 'data-state="degraded"' in status[:200]
    assert f"{worker.name}: {LONG_CAUSE}" in status  # the whole first line, never cut before its cause
    assert 'data-testid="backoff"' in status and 'data-testid="retry-now"' in status
    assert f'hx-target="#deployment-{deployment.pk}-answer"' in status  # it answers in the card's answer line
    assert f'id="deployment-{deployment.pk}-answer"' in page
    catalog = operator_client.get(reverse("dashboard:catalog")).content.decode()
    assert 'data-testid="model-degraded"' in catalog and LONG_CAUSE in catalog

    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(reverse("dashboard:deployment_retry", args=[deployment.pk]), **HTMX)
    fragment = response.content.decode()
    assert fragment.lstrip().startswith(f'<div class="action-answer" id="deployment-{deployment.pk}-answer"')
    assert "Retrying" in fragment and 'data-testid="retry-now"' not in fragment and _says_fleet_changed(response)
    assert not deployment.load_backoffs.exists()
    entry = _audit("deployment.retry")
    assert (entry.actor, entry.detail) == (operator, {"backoffs": {worker.name: 3}})

    # Again, with nothing left to retry: the refusal is shown in the deployment's answer line.
    fragment = operator_client.post(
        reverse("dashboard:deployment_retry", args=[deployment.pk]), **HTMX
    ).content.decode()
    assert fragment.lstrip().startswith(f'<div class="action-answer" id="deployment-{deployment.pk}-answer"')
    assert "has no failed loads to retry" in fragment and 'data-testid="action-error"' in fragment
