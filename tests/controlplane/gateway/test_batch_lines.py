"""The batch runner's yield to interactive traffic: a replica with interactive requests in flight
gets no new batch lines; batch lines in flight do not count against it. Without Redis the runner
(in the Celery worker) sees the web process's requests through the live cache's files."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from controlplane.gateway.batch_lines import _idle_replicas
from controlplane.gateway.local_shared import LocalShared
from controlplane.gateway.selectors import ReplicaRoute
from tests.controlplane.gateway.test_shared import _config

REPLICAS = (ReplicaRoute(1, "http://a"), ReplicaRoute(2, "http://b"))

# A gateway process of the embedded set-up (no Redis, the live cache under VAR_DIR) that sends one
# interactive request to replica 1 and dies before it finishes.
_GATEWAY_DIES_MID_REQUEST = """
import asyncio, time, django
django.setup()
from controlplane.gateway.local_shared import LocalShared
from controlplane.gateway.selectors import ReplicaRoute
from tests.controlplane.gateway.test_shared import _config
asyncio.run(LocalShared(_config()).pick([ReplicaRoute(1, "http://a")], "req_cut_off", None))
print("in flight", flush=True)
time.sleep(600)
"""


@pytest.fixture
def live_files(settings, tmp_path):
    """The embedded set-up's live cache: files under VAR_DIR, read by every process."""
    var = tmp_path / "var"
    settings.REDIS_URL = ""
    settings.CACHES = {
        **settings.CACHES,
        "live": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(var / "cache" / "live"),
        },
    }
    return var


async def test_batch_lines_go_only_to_replicas_without_interactive_requests(settings, live_files):
    settings.BATCH_REPLICA_BUSY_AT = 1
    shared = LocalShared(_config())
    run = SimpleNamespace(shared=shared)
    await shared.pick(REPLICAS[:1], "req_interactive", None)
    await shared.pick(REPLICAS[1:], "batch_abc:1", None)
    assert await _idle_replicas(run, REPLICAS) == REPLICAS[1:]
    settings.BATCH_REPLICA_BUSY_AT = 2  # a replica may take lines beside one interactive request
    assert await _idle_replicas(run, REPLICAS) == REPLICAS
    settings.BATCH_REPLICA_BUSY_AT = 1
    await shared.finish("req_interactive", replica_id=1)
    assert await _idle_replicas(run, REPLICAS) == REPLICAS


async def test_without_redis_the_runner_yields_to_the_web_process_requests(settings, live_files):
    # Two processes' states on the same files: the web process's gateway and the Celery worker's runner.
    settings.BATCH_REPLICA_BUSY_AT = 1
    gateway, runner = LocalShared(_config()), LocalShared(_config())
    run = SimpleNamespace(shared=runner)
    await runner.pick(REPLICAS[1:], "batch_abc:1", None)
    await gateway.pick(REPLICAS[:1], "req_a", None)
    await gateway.pick(REPLICAS[:1], "req_b", None)
    assert await runner.interactive_outstanding([1, 2]) == {1: 2, 2: 0}
    assert await _idle_replicas(run, REPLICAS) == REPLICAS[1:]
    await gateway.finish("req_a", replica_id=1)
    assert await _idle_replicas(run, REPLICAS) == REPLICAS[1:]
    await gateway.finish("req_b", replica_id=1)
    assert await runner.interactive_outstanding([1, 2]) == {1: 0, 2: 0}
    assert await _idle_replicas(run, REPLICAS) == REPLICAS


async def test_a_request_of_a_killed_gateway_holds_batch_lines_only_until_its_deadline(
    settings, live_files, monkeypatch
):
    settings.BATCH_REPLICA_BUSY_AT = 1
    env = {**os.environ, "REDIS_URL": "", "VAR_DIR": str(live_files), "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    gateway = subprocess.Popen(
        [sys.executable, "-c", _GATEWAY_DIES_MID_REQUEST], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert gateway.stdout.readline() == "in flight\n"
    finally:
        gateway.kill()
        gateway.wait(30)
    run = SimpleNamespace(shared=LocalShared(_config()))
    assert await _idle_replicas(run, REPLICAS) == REPLICAS[1:]  # the request might still run on the replica
    later = time.time() + _config().hold_lifetime_s + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert await run.shared.interactive_outstanding([1]) == {1: 0}
    assert await _idle_replicas(run, REPLICAS) == REPLICAS
