"""The autoscaler as the beat task runs it: synthetic heartbeats through the real heartbeat service
(into the live cache, Redis), requests counted by the gateway's real traffic recorder (Redis), and
decisions applied through the deployment scaling path with their audit entries."""

import asyncio
from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.fleet import heartbeat_cache, tasks
from controlplane.fleet.models import AutoscaleDecision, Replica
from controlplane.fleet.services.autoscaling import deployments_autoscale
from controlplane.fleet.services.deployments import deployment_create, deployment_scale, deployment_update
from controlplane.fleet.services.heartbeats import worker_heartbeat
from controlplane.fleet.traffic import RedisTraffic
from gpuworker.contract.heartbeat import parse_heartbeat
from tests.conftest import require_service
from tests.controlplane.factories import DeploymentFactory, ModelFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker

pytestmark = pytest.mark.django_db

URL = "http://127.0.0.1:8101"
LONG_AGO = timedelta(hours=2)


@pytest.fixture(autouse=True)
def _policy(settings):
    if not django_settings.REDIS_URL:
        require_service("REDIS_URL is not set")
    settings.AUTOSCALE_TARGET_UTILISATION_PERCENT = 70
    settings.AUTOSCALE_HYSTERESIS_PERCENT = 20
    settings.AUTOSCALE_SCALE_UP_COOLDOWN_SECONDS = 30
    settings.AUTOSCALE_SCALE_DOWN_COOLDOWN_SECONDS = 300
    settings.AUTOSCALE_POPULAR_TOP_K = 0
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    for key in client.scan_iter("gw:traffic:*"):
        client.delete(key)
    yield
    client.close()


def _deployment(*, desired=1, max_replicas=4, **fields):
    fields.setdefault("autoscale", True)
    return DeploymentFactory(
        desired_replicas=desired,
        max_replicas=max_replicas,
        target_concurrency=4,
        idle_to_zero_seconds=600,
        scaled_at=timezone.now() - LONG_AGO,
        **fields,
    )


def _ready_replicas(deployment, worker, count):
    return [
        ReplicaFactory(deployment=deployment, worker=worker, state=Replica.State.READY, endpoint_url=URL)
        for _ in range(count)
    ]


def _beat(worker, figures_by_replica):
    """One heartbeat from `worker` reporting each replica ready with its figures."""
    heartbeat = parse_heartbeat(
        {
            "draining": False,
            "gpus": [],
            "cpu": {"utilization_pct": 3.0},
            "replicas": [
                {"replica_id": replica.pk, "state": "ready", "endpoint_url": URL, **figures}
                for replica, figures in figures_by_replica.items()
            ],
        }
    )
    worker_heartbeat(worker_id=worker.pk, heartbeat=heartbeat, now=timezone.now())


def _requests(model_id, *, count=1, ago=timedelta(0)):
    async def record():
        traffic = RedisTraffic(django_settings.REDIS_URL)
        for _ in range(count):
            await traffic.record(model_id, (timezone.now() - ago).timestamp())
        await traffic.aclose()

    asyncio.run(record())


def _autoscale_entries(deployment):
    return list(
        AuditEntry.objects.filter(
            target_id=str(deployment.pk),
            actor_label="system",
            action=AuditEntry.Action.DEPLOYMENT_SCALE,
            detail__has_key="autoscaler",
        )
    )


def test_scales_up_on_queued_requests_and_records_why():
    deployment = _deployment()
    worker = make_worker()
    (replica,) = _ready_replicas(deployment, worker, 1)
    _beat(worker, {replica: {"running": 4, "waiting": 6, "kv_cache_usage": 0.4}})
    _requests(deployment.model_id, count=20)
    (decision,) = deployments_autoscale(now=timezone.now())
    deployment.refresh_from_db()
    # 10 in flight / (4 per replica × 0.7) → 4 replicas (the maximum).
    assert deployment.desired_replicas == 4
    assert (decision.action, decision.desired_replicas) == ("up", 4)
    assert "utilisation 250% of 1 ready" in decision.reason
    assert decision.inputs["waiting"] == 6 and decision.inputs["kv_cache_usage"] == 0.4
    assert decision.inputs["request_rate_per_s"] > 0
    (entry,) = _autoscale_entries(deployment)
    assert entry.actor is None and entry.detail["desired_replicas"] == [1, 4]
    assert entry.detail["autoscaler"] == decision.reason and entry.detail["inputs"]["waiting"] == 6
    assert deployment.scaled_at > timezone.now() - timedelta(minutes=1)


def test_scales_up_on_a_ttft_slo_breach_read_from_the_heartbeat_cache():
    deployment = _deployment(ttft_slo_ms=500)
    worker = make_worker()
    (replica,) = _ready_replicas(deployment, worker, 1)
    # The figures as the heartbeat service stores them; missing ones (itl_p95_s here) read as None.
    heartbeat_cache.store(
        worker_id=worker.pk,
        state={
            "worker_id": worker.pk,
            "replicas": {
                str(replica.pk): {
                    "state": "ready",
                    "running": 2,
                    "waiting": 0,
                    "kv_cache_usage": 0.2,
                    "ttft_p95_s": 0.9,
                }
            },
        },
    )
    _requests(deployment.model_id)
    (decision,) = deployments_autoscale(now=timezone.now())
    deployment.refresh_from_db()
    assert (deployment.desired_replicas, decision.action) == (2, "up")
    assert "TTFT p95 0.90 s above the 0.50 s SLO" in decision.reason
    assert decision.inputs["itl_p95_s"] is None


def test_a_second_tick_inside_the_cooldown_holds_and_stores_why():
    deployment = _deployment()
    worker = make_worker()
    (replica,) = _ready_replicas(deployment, worker, 1)
    _beat(worker, {replica: {"running": 4, "waiting": 6, "kv_cache_usage": 0.4}})
    _requests(deployment.model_id)
    deployments_autoscale(now=timezone.now())
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 4
    deployment_update(deployment=deployment, desired_replicas=2, min_replicas=0, max_replicas=4, keep_warm=False)
    # The operator's change restarts the cooldown: the busy replica does not scale it back up yet.
    (decision,) = deployments_autoscale(now=timezone.now())
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 2
    assert decision.action == "hold" and "cooling down" in decision.reason
    assert AutoscaleDecision.objects.get(deployment=deployment).reason == decision.reason
    assert len(_autoscale_entries(deployment)) == 1


def test_scales_down_when_the_replicas_are_mostly_idle():
    deployment = _deployment(desired=3)
    worker = make_worker()
    replicas = _ready_replicas(deployment, worker, 3)
    _beat(
        worker,
        {
            replicas[0]: {"running": 1, "waiting": 0},
            replicas[1]: {"running": 0, "waiting": 0},
            replicas[2]: {"running": 0, "waiting": 0},
        },
    )
    _requests(deployment.model_id, count=3)
    (decision,) = deployments_autoscale(now=timezone.now())
    deployment.refresh_from_db()
    assert (deployment.desired_replicas, decision.action) == (1, "down")
    (entry,) = _autoscale_entries(deployment)
    assert entry.detail["desired_replicas"] == [3, 1]


def test_scales_to_zero_after_the_idle_period_and_back_up_when_requests_come():
    deployment = _deployment()
    worker = make_worker()
    (replica,) = _ready_replicas(deployment, worker, 1)
    _beat(worker, {replica: {"running": 0, "waiting": 0}})
    _requests(deployment.model_id, ago=timedelta(minutes=11))
    (decision,) = deployments_autoscale(now=timezone.now())
    deployment.refresh_from_db()
    assert (deployment.desired_replicas, decision.action) == (0, "down")
    assert decision.reason.startswith("idle for 11 min")
    # The replica is gone; a request arrives for the model: a replica is wanted again at once,
    # whatever the cooldown.
    Replica.objects.filter(pk=replica.pk).update(state=Replica.State.STOPPED)
    _requests(deployment.model_id)
    (decision,) = deployments_autoscale(now=timezone.now())
    deployment.refresh_from_db()
    assert (deployment.desired_replicas, decision.action) == (1, "up")
    assert "no replica is running" in decision.reason


def test_popular_models_and_keep_warm_stay_at_one(settings):
    settings.AUTOSCALE_POPULAR_TOP_K = 1
    popular, quiet, warm = _deployment(), _deployment(), _deployment(keep_warm=True)
    worker = make_worker()
    replicas = {d: _ready_replicas(d, worker, 1)[0] for d in (popular, quiet, warm)}
    _beat(worker, {r: {"running": 0, "waiting": 0} for r in replicas.values()})
    _requests(popular.model_id, count=5, ago=timedelta(minutes=20))
    _requests(quiet.model_id, count=1, ago=timedelta(minutes=20))
    decisions = {d.deployment_id: d for d in deployments_autoscale(now=timezone.now())}
    for deployment in (popular, quiet, warm):
        deployment.refresh_from_db()
    assert (popular.desired_replicas, quiet.desired_replicas, warm.desired_replicas) == (1, 0, 1)
    assert decisions[popular.pk].inputs["popular"] is True and decisions[quiet.pk].inputs["popular"] is False


def test_deployments_with_autoscaling_off_are_left_alone():
    deployment = _deployment(autoscale=False)
    assert deployments_autoscale(now=timezone.now()) == []
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 1 and not AutoscaleDecision.objects.exists()


def test_unreadable_traffic_counts_decide_nothing(settings):
    """Redis down: no requests seen must not read as no requests (which would scale to zero)."""
    deployment = _deployment()
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    assert deployments_autoscale(now=timezone.now()) == []
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 1


def test_the_beat_task_counts_its_decisions(settings):
    _deployment()
    assert "fleet-autoscale" in settings.CELERY_BEAT_SCHEDULE
    assert tasks.autoscale() == {"up": 0, "down": 0, "hold": 1}


def test_new_deployments_autoscale_unless_created_hand_scaled():
    auto = deployment_create(model_name=ModelFactory().public_name)
    manual = deployment_create(model_name=ModelFactory().public_name, autoscale=False)
    assert (auto.autoscale, manual.autoscale) == (True, False)
    assert auto.scaled_at is not None and auto.target_concurrency == django_settings.AUTOSCALE_TARGET_CONCURRENCY


def test_manual_scale_still_works_and_restarts_the_cooldown():
    deployment = _deployment()
    deployment_scale(deployment=deployment, desired_replicas=3)
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 3 and deployment.scaled_at > timezone.now() - timedelta(minutes=1)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("target_concurrency", 0, "Must lie between 1 and 1,024; got 0."),
        ("ttft_slo_ms", 10_000_000, "Must lie between 1 and 600,000"),
        ("itl_slo_ms", "fast", "Must be a whole number"),
        ("idle_to_zero_seconds", -1, "Must lie between 0 and"),
        ("autoscale", "yes", "Must be true or false"),
    ],
)
def test_autoscaling_settings_are_checked_per_field(field, value, message):
    deployment = _deployment()
    with pytest.raises(ValidationError) as error:
        deployment_update(
            deployment=deployment, desired_replicas=1, min_replicas=0, max_replicas=4, keep_warm=False, **{field: value}
        )
    assert message in error.value.message_dict[field][0]


def test_autoscaling_settings_are_saved_and_audited():
    deployment = _deployment()
    deployment_update(
        deployment=deployment,
        desired_replicas=1,
        min_replicas=0,
        max_replicas=4,
        keep_warm=False,
        autoscale=False,
        target_concurrency=16,
        ttft_slo_ms=500,
        itl_slo_ms=40,
        idle_to_zero_seconds=0,
    )
    deployment.refresh_from_db()
    assert (
        deployment.autoscale,
        deployment.target_concurrency,
        deployment.ttft_slo_ms,
        deployment.itl_slo_ms,
        deployment.idle_to_zero_seconds,
    ) == (False, 16, 500, 40, 0)
    entry = AuditEntry.objects.get(action=AuditEntry.Action.DEPLOYMENT_UPDATE, target_id=str(deployment.pk))
    assert entry.detail["target_concurrency"] == [4, 16] and entry.detail["autoscale"] == [True, False]


def test_a_request_queued_for_a_cold_start_keeps_the_model_from_scaling_to_zero():
    """The gateway's cold-start queue (the real Redis set it writes) counts as demand: an idle
    deployment with a request waiting for its first replica is not scaled to zero under it."""
    from controlplane.fleet.cold_start_counts import redis_key

    deployment = _deployment(desired=1)
    _requests(deployment.model_id, ago=timedelta(minutes=11))
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    key = redis_key(deployment.model_id)
    client.zadd(key, {"req-waiting": int((timezone.now() + timedelta(minutes=1)).timestamp() * 1000)})
    try:
        (decision,) = deployments_autoscale(now=timezone.now())
    finally:
        client.delete(key)
        client.close()
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 1
    assert decision.inputs["queued_cold_starts"] == 1
    assert decision.action != "down"
