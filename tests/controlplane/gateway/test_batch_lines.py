"""The batch runner's yield to interactive traffic: a replica with interactive requests in flight
gets no new batch lines; batch lines in flight do not count against it."""

from types import SimpleNamespace

from controlplane.gateway.batch_lines import _idle_replicas
from controlplane.gateway.local_shared import LocalShared
from controlplane.gateway.selectors import ReplicaRoute
from tests.controlplane.gateway.test_shared import _config

REPLICAS = (ReplicaRoute(1, "http://a"), ReplicaRoute(2, "http://b"))


async def test_batch_lines_go_only_to_replicas_without_interactive_requests(settings):
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
