"""Staging: the pure plan of which checkpoints each worker keeps warm, and its sending on the
reconcile beat (only when a worker's list changed), through the real database, cache and broker."""

import asyncio
import time

import pytest
import redis

from controlplane.fleet import heartbeat_cache
from controlplane.fleet.models import Replica
from controlplane.fleet.services.staging import workers_stage_weights
from controlplane.fleet.staging import StagingCandidate, StagingWorker, plan_staging
from controlplane.fleet.traffic import RedisTraffic
from tests.controlplane.factories import DeploymentFactory, ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker, queued_tasks

GB = 10**9


def _worker(worker_id=1, budget=40 * GB, paths=("/m/a", "/m/b", "/m/c"), running=()):
    return StagingWorker(
        worker_id=worker_id, budget_bytes=budget, model_paths=frozenset(paths), running_paths=frozenset(running)
    )


def _candidate(path, traffic, size=16 * GB, headroom=True):
    return StagingCandidate(model_path=path, weight_bytes=size, traffic=traffic, headroom=headroom)


def test_busiest_models_with_headroom_first_within_the_budget():
    candidates = [_candidate("/m/a", 1), _candidate("/m/b", 5), _candidate("/m/c", 3)]
    assert plan_staging([_worker()], candidates) == {1: ("/m/b", "/m/c")}  # 3 x 16 GB > 40 GB


def test_models_at_their_maximum_running_here_or_not_found_here_are_not_staged():
    candidates = [
        _candidate("/m/a", 9, headroom=False),
        _candidate("/m/b", 5),
        _candidate("/m/x", 4),
        _candidate("/m/c", 3),
    ]
    plan = plan_staging([_worker(running=("/m/b",)), _worker(worker_id=2, paths=("/m/x",))], candidates)
    assert plan == {1: ("/m/c",), 2: ("/m/x",)}


def test_a_model_larger_than_the_budget_is_passed_over_for_smaller_ones():
    candidates = [_candidate("/m/a", 9, size=50 * GB), _candidate("/m/b", 1, size=10 * GB)]
    assert plan_staging([_worker()], candidates) == {1: ("/m/b",)}
    assert plan_staging([_worker(budget=0)], candidates) == {1: ()}


def _heartbeat_state(worker, budget):
    heartbeat_cache.store(
        worker_id=worker.pk, state={"worker_id": worker.pk, "staging": {"budget_bytes": budget, "models": []}}
    )


def _requests(redis_url, counts):
    async def record():
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter("gw:traffic:*"):
            client.delete(key)
        client.close()
        traffic = RedisTraffic(redis_url)
        for model_id, count in counts.items():
            for _ in range(count):
                await traffic.record(model_id, time.time())
        await traffic.aclose()

    asyncio.run(record())


@pytest.mark.django_db
def test_plans_are_sent_to_the_worker_queue_only_when_they_change(redis_url, django_capture_on_commit_callbacks):
    busy = DeploymentFactory(desired_replicas=2, max_replicas=4, model__gpu_memory_bytes=16 * GB)
    quiet = DeploymentFactory(desired_replicas=1, max_replicas=2, model__gpu_memory_bytes=16 * GB)
    full = DeploymentFactory(desired_replicas=2, max_replicas=2, model__gpu_memory_bytes=16 * GB)
    paths = [d.model.weights_path for d in (busy, quiet, full)]
    worker = make_worker(model_paths=paths)
    _heartbeat_state(worker, 20 * GB)
    # Busiest by the gateway's own request counts (Redis), not by replicas wanted.
    _requests(redis_url, {busy.model_id: 3, quiet.model_id: 1, full.model_id: 9})
    queued_tasks(worker.queue_name)

    with django_capture_on_commit_callbacks(execute=True):
        assert workers_stage_weights() == {worker.pk: (busy.model.weights_path,)}
    assert queued_tasks(worker.queue_name) == [("gpuworker.stage_weights", {"model_paths": [busy.model.weights_path]})]
    assert workers_stage_weights() == {}  # unchanged: nothing sent
    assert queued_tasks(worker.queue_name) == []

    # A replica of the busy model starts here: its weights are loaded, so the next one is staged.
    ReplicaFactory(deployment=busy, worker=worker, state=Replica.State.READY)
    with django_capture_on_commit_callbacks(execute=True):
        assert workers_stage_weights() == {worker.pk: (quiet.model.weights_path,)}
    assert queued_tasks(worker.queue_name)[0][1] == {"model_paths": [quiet.model.weights_path]}


@pytest.mark.django_db
def test_a_worker_without_a_staging_report_is_told_to_stage_nothing(redis_url, django_capture_on_commit_callbacks):
    deployment = DeploymentFactory(desired_replicas=1, max_replicas=3)
    worker = make_worker(model_paths=[deployment.model.weights_path])  # no heartbeat cached yet
    queued_tasks(worker.queue_name)
    with django_capture_on_commit_callbacks(execute=True):
        assert workers_stage_weights() == {worker.pk: ()}
    assert queued_tasks(worker.queue_name) == [("gpuworker.stage_weights", {"model_paths": []})]
