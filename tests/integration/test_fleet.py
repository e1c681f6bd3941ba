"""The fleet end to end (issue 5): real daemons on CPU load and unload tiny models as deployments
change, a killed daemon's replicas are replaced elsewhere, a bad model fails without a retry loop,
and bad task arguments leave a daemon serving."""

import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from django.db import connection

from controlplane.catalog.models import Deployment
from controlplane.celery import app as celery_app
from controlplane.fleet.models import RebalanceMove, Replica, Worker
from controlplane.fleet.selectors import deployment_statuses
from controlplane.fleet.services.deployments import deployment_scale
from tests.controlplane.factories import DeploymentFactory, ModelFactory
from tests.integration.conftest import DRAIN_TIMEOUT_S, wait_until
from tests.processes import children_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

State = Replica.State


def _deployment(weights_path, *, desired=0, max_replicas=2, tensor_parallel_size=1) -> Deployment:
    model = ModelFactory(
        weights_path=str(weights_path),
        context_length=512,
        gpu_memory_bytes=64 * 1024**2,
        tensor_parallel_size=tensor_parallel_size,
    )
    return DeploymentFactory(model=model, desired_replicas=desired, min_replicas=0, max_replicas=max_replicas)


def _online_workers(fleet, count):
    def check():
        workers = list(Worker.objects.filter(state=Worker.State.ONLINE))
        return workers if len(workers) == count else None

    return wait_until(check, timeout=60, what=f"{count} daemons online", fleet=fleet)


def _ready(deployment, count, fleet, timeout=120):
    def check():
        ready = list(Replica.objects.filter(deployment=deployment, state=State.READY))
        return ready if len(ready) == count else None

    return wait_until(
        check, timeout=timeout, what=f"{count} ready replicas of {deployment.model.public_name}", fleet=fleet
    )


@dataclass
class Request:
    replica_id: int
    started: float
    ended: float = 0.0
    completed: bool = False
    error: str = ""


class Load:
    """Streams chat completions (a few seconds each on CPU) against the deployment's ready
    replicas, as the gateway will:
    a replica that refuses before streaming (draining, gone) is retried on another; a stream
    that starts must end with [DONE], or the request is lost."""

    def __init__(self, deployment, token, streams=2):
        self.deployment, self.token = deployment, token
        self.requests: list[Request] = []
        self.refused = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(streams)]

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def in_flight(self, replica_id):
        with self._lock:
            return [r for r in self.requests if r.replica_id == replica_id and not r.ended]

    def lost(self):
        return [r for r in self.requests if r.ended and not r.completed]

    def _run(self, offset):
        with httpx.Client(headers={"Authorization": f"Bearer {self.token}"}, timeout=60) as client:
            turn = offset
            while not self._stop.is_set():
                targets = list(
                    Replica.objects.filter(deployment=self.deployment, state=State.READY).values_list(
                        "pk", "endpoint_url"
                    )
                )
                if not targets:
                    time.sleep(0.1)
                    continue
                turn += 1
                self._one(client, *targets[turn % len(targets)])
        connection.close()

    def _one(self, client, replica_id, endpoint_url):
        body = {
            "model": self.deployment.model.public_name,
            "stream": True,
            "max_tokens": 300,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "stream while the fleet changes"}],
        }
        request = Request(replica_id, time.monotonic())
        try:
            with client.stream("POST", f"{endpoint_url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    self.refused += 1
                    return
                with self._lock:
                    self.requests.append(request)
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        request.completed = True
                    elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                        request.error = line
        except httpx.ConnectError:
            self.refused += 1  # nothing was accepted: the client tries another replica
        except httpx.HTTPError as exc:
            request.error = repr(exc)
        finally:
            request.ended = time.monotonic()


def test_scale_0_to_2_across_two_daemons_and_back_to_0_while_streaming(fleet, tiny_model_path):
    a, b = fleet.start_daemon("a"), fleet.start_daemon("b")
    workers = _online_workers(fleet, 2)
    deployment = _deployment(tiny_model_path)

    deployment_scale(deployment=deployment, desired_replicas=2, actor=None)
    ready = _ready(deployment, 2, fleet)
    assert {r.worker_id for r in ready} == {w.pk for w in workers}  # one on each daemon

    with Load(deployment, fleet.token) as load:
        # Scale down while requests stream on both replicas.
        wait_until(lambda: all(load.in_flight(r.pk) for r in ready), timeout=60, what="requests on both replicas")
        scaled_at = time.monotonic()
        deployment_scale(deployment=deployment, desired_replicas=1, actor=None)
        drained = wait_until(
            lambda: (
                Replica.objects.filter(deployment=deployment, state=State.DRAINING).first()
                or Replica.objects.filter(deployment=deployment, state=State.STOPPED).first()
            ),
            timeout=30,
            what="one replica drained",
            fleet=fleet,
        )
        draining_seen_at = time.monotonic()
        wait_until(
            lambda: Replica.objects.filter(pk=drained.pk, state=State.STOPPED).exists(),
            timeout=DRAIN_TIMEOUT_S + 60,
            what="the drained replica stopped",
            fleet=fleet,
        )
        survivor = Replica.objects.get(deployment=deployment, state=State.READY)
        wait_until(lambda: load.in_flight(survivor.pk), timeout=30, what="requests on the survivor")
        deployment_scale(deployment=deployment, desired_replicas=0, actor=None)
        wait_until(
            lambda: not Replica.objects.filter(deployment=deployment, state__in=Replica.LIVE_STATES).exists(),
            timeout=DRAIN_TIMEOUT_S + 60,
            what="every replica stopped",
            fleet=fleet,
        )

    served = {r.replica_id for r in load.requests if r.completed}
    assert served == {r.pk for r in ready}, "both replicas served requests"
    assert load.lost() == [], load.lost()
    # Requests were in flight on the drained replica when it was told to drain, and finished.
    caught = [
        r for r in load.requests if r.replica_id == drained.pk and r.started < scaled_at < draining_seen_at < r.ended
    ]
    assert caught and all(r.completed for r in caught)
    assert [r.error for r in load.requests if r.error] == []
    assert set(Replica.objects.filter(deployment=deployment).values_list("state", flat=True)) == {State.STOPPED}
    assert a.popen.poll() is None and b.popen.poll() is None
    [status] = deployment_statuses(deployment_ids=[deployment.pk])
    assert status.state == "stopped"


def test_a_killed_daemon_is_lost_and_its_replica_replaced(fleet, tiny_model_path):
    daemons = {p.name: p for p in (fleet.start_daemon("a"), fleet.start_daemon("b"))}
    _online_workers(fleet, 2)
    deployment = _deployment(tiny_model_path)
    deployment_scale(deployment=deployment, desired_replicas=1, actor=None)
    [first] = _ready(deployment, 1, fleet)
    victim = daemons[first.worker.name]

    fleet.kill(victim)
    # Failed once the worker is silent for FLEET_WORKER_LOST_AFTER_SECONDS (no timing bound here:
    # a busy machine only delays it).
    wait_until(
        lambda: Replica.objects.filter(pk=first.pk, state=State.FAILED).exists(),
        timeout=90,
        what="the replica failed",
        fleet=fleet,
    )
    first.refresh_from_db()
    assert first.failure == Replica.Failure.WORKER_LOST and "lost" in first.last_error
    assert Worker.objects.get(pk=first.worker_id).state == Worker.State.LOST

    [replacement] = _ready(deployment, 1, fleet)
    assert replacement.worker_id != first.worker_id


def test_replicas_crowded_on_one_daemon_spread_to_a_second_one_without_losing_a_stream(fleet, tiny_model_path):
    fleet.start_daemon("a")
    [a] = _online_workers(fleet, 1)
    deployment = _deployment(tiny_model_path)
    deployment_scale(deployment=deployment, desired_replicas=2, actor=None)
    crowded = _ready(deployment, 2, fleet)
    assert {r.worker_id for r in crowded} == {a.pk}
    ready_counts = []

    def spread():
        ready = list(
            Replica.objects.filter(deployment=deployment, state=State.READY).values_list("worker_id", flat=True)
        )
        ready_counts.append(len(ready))
        stopped = Replica.objects.filter(pk__in=[r.pk for r in crowded], state=State.STOPPED).exists()
        return len(ready) == 2 and len(set(ready)) == 2 and stopped

    with Load(deployment, fleet.token) as load:
        fleet.start_daemon("b")
        wait_until(spread, timeout=180, what="one replica on each daemon, the extra one stopped", fleet=fleet)
    # Make before break: as often as it was looked at, never fewer ready than wanted, and every
    # stream that started (on the drained replica too) ended with [DONE].
    assert min(ready_counts) >= 2
    assert load.requests and not load.lost(), [r.error for r in load.lost()]
    assert RebalanceMove.objects.get(deployment=deployment).state == RebalanceMove.State.MOVED


def test_a_wrong_weight_path_is_retried_with_backoff_and_bad_task_args_leave_daemons_serving(fleet, tiny_model_path):
    daemons = [fleet.start_daemon("a"), fleet.start_daemon("b")]
    workers = _online_workers(fleet, 2)
    broken = _deployment(tiny_model_path.parent / "no-such-model", max_replicas=1)
    deployment_scale(deployment=broken, desired_replicas=1, actor=None)

    def degraded_status():
        [status] = deployment_statuses(deployment_ids=[broken.pk])
        return status if status.state == "degraded" else None

    status = wait_until(degraded_status, timeout=120, what="the broken deployment degraded", fleet=fleet)
    assert "no-such-model" in status.last_error
    # Tried on both daemons, and again on each only once its backoff (2 s, doubling) had passed:
    # no retry loop.
    attempts = list(Replica.objects.filter(deployment=broken).order_by("created_at", "pk"))
    assert {r.worker_id for r in attempts} == {w.pk for w in workers}
    assert any(r.failure == Replica.Failure.LOAD for r in attempts)
    for worker in workers:
        mine = [r for r in attempts if r.worker_id == worker.pk]
        failed_loads = 0
        for before, after in zip(mine, mine[1:]):
            # (A busy machine can delay heartbeats enough for a worker to be marked lost for a
            # moment: that failure is not the model's and sets no backoff.)
            if before.failure == Replica.Failure.LOAD:
                failed_loads += 1
                waited = (after.created_at - before.state_changed_at).total_seconds()
                assert waited >= min(8, 2 * 2 ** (failed_loads - 1)), (failed_loads, waited)

    # Bad arguments straight onto each daemon's queue: rejected with a logged reason.
    for worker in workers:
        for name, kwargs in [
            ("gpuworker.load_model", {"replica_id": "seven", "model_path": 3}),
            ("gpuworker.unload_model", {"replica_id": 1, "surprise": True}),
            ("gpuworker.drain_worker", {"timeout_s": -5}),
        ]:
            celery_app.send_task(name, kwargs=kwargs, queue=worker.queue_name)
    wait_until(
        lambda: all("rejected gpuworker.drain_worker" in d.log_path.read_text() for d in daemons),
        timeout=30,
        what="both daemons logging the rejections",
        fleet=fleet,
    )

    # Both daemons still serve: a good model loads on each of them.
    good = _deployment(tiny_model_path)
    deployment_scale(deployment=good, desired_replicas=2, actor=None)
    ready = _ready(good, 2, fleet)
    assert {r.worker_id for r in ready} == {w.pk for w in workers}
    assert all(d.popen.poll() is None for d in daemons)
    assert set(Worker.objects.values_list("state", flat=True)) == {Worker.State.ONLINE}


def test_a_split_replica_is_placed_loaded_over_two_ranks_and_answers(fleet, tiny_model_path):
    """tensor_parallel_size 2 on a CPU daemon: reconcile sends it with the load, the daemon's replica
    runs two gloo ranks (a serve process and its rank child) and answers as one replica."""
    daemon = fleet.start_daemon("tp")
    [worker] = _online_workers(fleet, 1)
    deployment = _deployment(tiny_model_path, max_replicas=1, tensor_parallel_size=2)
    deployment_scale(deployment=deployment, desired_replicas=1, actor=None)
    [replica] = _ready(deployment, 1, fleet, timeout=180)
    assert (replica.worker_id, replica.gpu_id, replica.tensor_parallel_size) == (worker.pk, None, 2)
    # The second rank: a spawned child below the daemon's replica process.
    ranks = children_running("spawn_main", daemon.popen.pid, recursive=True)
    assert len(ranks) == 1
    completion = httpx.post(
        f"{replica.endpoint_url}/v1/completions",
        headers={"Authorization": f"Bearer {fleet.token}"},
        json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4
