"""The lost-worker judge (`services.workers_mark_lost`) against the real database and Redis: a
worker is lost only from evidence that it stopped, never because the control plane could not
record its heartbeats.

Each check is given its time, as beat brings them once a second; a check not made is one that
could not run (its database, Redis, broker or Celery down). Replicas are real servers or real
closed ports."""

import logging
import socket
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.fleet.lost_watch import REPLICAS_ANSWER
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.selectors import lost_judgement
from controlplane.fleet.services.heartbeats import worker_heartbeat, workers_mark_lost
from gpuworker.contract.heartbeat import parse_heartbeat
from tests.controlplane.factories import ReplicaFactory
from tests.controlplane.fleet.conftest import make_worker
from tests.private_services import PrivateRedis

pytestmark = pytest.mark.django_db

State = Replica.State
SECOND = timedelta(seconds=1)


def _closed_port_url() -> str:
    """An endpoint nothing listens on (a replica that is gone): a port the OS chose, closed again."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _beat(worker, *, now):
    """A heartbeat of `worker` reporting its ready replicas as ready."""
    ready = Replica.objects.filter(worker=worker, state=State.READY).values_list("pk", "endpoint_url")
    worker_heartbeat(
        worker_id=worker.pk,
        now=now,
        heartbeat=parse_heartbeat(
            {"replicas": [{"replica_id": pk, "state": "ready", "endpoint_url": url} for pk, url in ready]}
        ),
    )


def _watch(start, end) -> int:
    """Checks each second from `start` to `end`: the judge watching without a break. Returns how
    many workers they changed."""
    changed = 0
    while start <= end:
        changed += workers_mark_lost(now=start)
        start += SECOND
    return changed


def _beat_and_watch(worker, start, end) -> int:
    """As _watch, with a heartbeat of `worker` recorded half a second before each check."""
    changed = 0
    while start <= end:
        _beat(worker, now=start - SECOND / 2)
        changed += workers_mark_lost(now=start)
        start += SECOND
    return changed


def _ready_replica(worker, url):
    return ReplicaFactory(worker=worker, state=State.READY, endpoint_url=url)


def _state(row):
    row.refresh_from_db()
    return row.state


def test_silent_workers_are_lost_and_their_replicas_failed(settings):
    settings.FLEET_WORKER_LOST_AFTER_SECONDS = 3
    now = timezone.now()
    silent, fresh = make_worker(state_changed_at=now - timedelta(minutes=1)), make_worker()
    _beat(silent, now=now - 4 * SECOND)
    _beat(fresh, now=now - SECOND)
    replica = _ready_replica(silent, _closed_port_url())
    kept = _ready_replica(fresh, _closed_port_url())
    Worker.objects.update(state_changed_at=now - timedelta(minutes=1))
    assert _watch(now - 10 * SECOND, now - SECOND) == 0
    assert workers_mark_lost(now=now) == 1
    assert (_state(silent), _state(fresh), _state(kept)) == (Worker.State.LOST, Worker.State.ONLINE, State.READY)
    replica.refresh_from_db()
    assert (replica.state, replica.failure) == (State.FAILED, Replica.Failure.WORKER_LOST)
    assert replica.last_error == f"Worker {silent.name} lost: no heartbeat for 4.0 s, and its replicas do not answer."


def test_a_just_registered_worker_is_not_lost():
    now = timezone.now()
    worker = make_worker(state_changed_at=now - SECOND)
    assert _watch(now - 10 * SECOND, now) == 0
    assert _state(worker) == Worker.State.ONLINE


def test_a_drained_worker_that_goes_quiet_is_offline_and_a_long_lost_one_too(settings):
    settings.FLEET_WORKER_LOST_AFTER_SECONDS, settings.FLEET_WORKER_OFFLINE_AFTER_SECONDS = 3, 10
    now = timezone.now()
    drained = make_worker(state=Worker.State.DRAINING, state_changed_at=now - timedelta(hours=1))
    lost = make_worker(state=Worker.State.LOST, state_changed_at=now - timedelta(hours=1))
    assert _watch(now - 20 * SECOND, now) == 2
    assert (_state(drained), _state(lost)) == (Worker.State.OFFLINE, Worker.State.OFFLINE)


def test_after_the_check_could_not_run_every_worker_has_a_whole_lost_window_again(settings, caplog):
    """The database (or Redis, the broker, Celery) was down for 10 s: no check ran, and no heartbeat
    could be recorded. A worker that beats again is kept; one that really stopped (its replica's
    port closed) is lost at the first check a whole lost window after the judge came back."""
    settings.FLEET_WORKER_LOST_AFTER_SECONDS = 3
    t0 = timezone.now() - timedelta(minutes=1)
    healthy, dead = make_worker(state_changed_at=t0 - 20 * SECOND), make_worker(state_changed_at=t0 - 20 * SECOND)
    kept, failed = _ready_replica(healthy, _closed_port_url()), _ready_replica(dead, _closed_port_url())
    for at in (t0 - 10 * SECOND, t0 - 5 * SECOND, t0):
        _beat(healthy, now=at), _beat(dead, now=at)
    assert _watch(t0 - 10 * SECOND, t0) == 0

    # The outage: 10 s without a check or a heartbeat. The first check after it judges no one.
    back = t0 + 10 * SECOND
    with caplog.at_level(logging.WARNING, logger="controlplane.fleet.services.heartbeats"):
        assert workers_mark_lost(now=back) == 0
    assert "lost-worker judgement paused: no check completed for 10.0 s" in caplog.text
    assert (_state(kept), _state(failed)) == (State.READY, State.READY)

    # The healthy worker's heartbeats are recorded again; the dead one's never are.
    assert _beat_and_watch(healthy, back + SECOND, back + 3 * SECOND) == 0  # not yet a whole lost window
    assert _beat_and_watch(healthy, back + 4 * SECOND, back + 4 * SECOND) == 1
    assert (_state(healthy), _state(kept)) == (Worker.State.ONLINE, State.READY)
    assert (_state(dead), _state(failed)) == (Worker.State.LOST, State.FAILED)


@pytest.fixture
def private_live_cache(settings, tmp_path):
    """The live cache (heartbeats, the judge's watch) on a Redis of this test's own, which it may
    stop and start; it comes back empty, as an unpersisted Redis does."""
    server = PrivateRedis(tmp_path)
    server.start()
    settings.CACHES = {
        **settings.CACHES,
        "live": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": server.url,
            "KEY_PREFIX": "test-live",
        },
    }
    yield server
    server.stop()


def test_a_redis_outage_that_empties_the_cache_loses_no_worker(settings, private_live_cache):
    """With the cache gone the check cannot run (nor can heartbeats be recorded); it comes back
    empty. An old state change is no measure of silence: a worker that beats again is kept, and
    one that stopped is lost a whole lost window after the judge came back."""
    settings.FLEET_WORKER_LOST_AFTER_SECONDS = 3
    t0 = timezone.now() - timedelta(minutes=1)
    registered = t0 - timedelta(minutes=10)
    healthy, dead = make_worker(state_changed_at=registered), make_worker(state_changed_at=registered)
    kept, failed = _ready_replica(healthy, _closed_port_url()), _ready_replica(dead, _closed_port_url())
    _beat(healthy, now=t0), _beat(dead, now=t0)
    assert _watch(t0 - 5 * SECOND, t0) == 0

    private_live_cache.stop()
    with pytest.raises(Exception) as error:
        workers_mark_lost(now=t0 + SECOND)
    assert type(error.value).__module__.startswith("redis")
    private_live_cache.start()

    back = t0 + 10 * SECOND
    assert workers_mark_lost(now=back) == 0
    assert (_state(kept), _state(failed)) == (State.READY, State.READY)
    assert _beat_and_watch(healthy, back + SECOND, back + 4 * SECOND) == 1
    assert (_state(healthy), _state(kept)) == (Worker.State.ONLINE, State.READY)
    assert (_state(dead), _state(failed)) == (Worker.State.LOST, State.FAILED)


def test_a_silent_worker_whose_replicas_answer_is_held_not_lost(settings, caplog, replica_server):
    """The control plane cannot record one worker's heartbeats (too busy, or unable to write them)
    while the judge runs: its replica still answers /health, so it is held and the judgement says
    it is paused; a worker whose replica does not answer is lost. Heard again, it is released."""
    from tests.controlplane.gateway.conftest import WORKER_TOKEN

    settings.FLEET_WORKER_LOST_AFTER_SECONDS = 3
    settings.FLEET_WORKER_TOKEN = WORKER_TOKEN
    now = timezone.now()
    running, stopped = (
        make_worker(state_changed_at=now - timedelta(minutes=1)),
        make_worker(state_changed_at=now - timedelta(minutes=1)),
    )
    kept, failed = _ready_replica(running, replica_server.url), _ready_replica(stopped, _closed_port_url())
    _beat(running, now=now - 10 * SECOND), _beat(stopped, now=now - 10 * SECOND)
    with caplog.at_level(logging.WARNING, logger="controlplane.fleet.services.heartbeats"):
        assert _watch(now - 20 * SECOND, now) == 1
    assert (_state(running), _state(kept)) == (Worker.State.ONLINE, State.READY)
    assert (_state(stopped), _state(failed)) == (Worker.State.LOST, State.FAILED)
    assert f"worker {running.name} silent for 4.0 s, but its replicas answer: not marked lost" in caplog.text
    assert lost_judgement(now=now).paused_reasons == [REPLICAS_ANSWER]

    _beat(running, now=now + 0.5 * SECOND)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="controlplane.fleet.services.heartbeats"):
        assert workers_mark_lost(now=now + SECOND) == 0
    assert f"worker {running.name} heard from again after 7.0 s held: its replicas were kept" in caplog.text
    assert lost_judgement(now=now + SECOND).paused_reasons == []
