"""A gateway process takes over the background responses whose process died as soon as it starts,
as `make run` starts it (launcher.process_specs): no request of its own needed."""

import pytest

from tests.controlplane.gateway.conftest import (
    background_response_finished,
    free_port,
    make_world,
    orphaned_background_response,
    start_gateway,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LEASE_S = 3  # the started process's claims, so that it looks for orphans every second


@pytest.fixture
def world(gateway, replicas):
    return make_world(gateway, replicas)


def test_a_web_process_takes_orphans_over_before_its_first_request(world, gateway, database_url, tmp_path):
    log_path = tmp_path / "web.log"
    with log_path.open("w") as log:
        web = start_gateway(
            database_url, gateway.redis_url, log=log, as_launched=True, GATEWAY_BACKGROUND_LEASE_SECONDS=str(LEASE_S)
        )
        try:
            orphan = orphaned_background_response(world)
            done = background_response_finished(orphan.pk, timeout=30)
        finally:
            web.stop()
    assert done.status in ("completed", "incomplete") and done.runs == 2
    assert done.response["output"]
    # Taken over by the process just started (the shared gateway looks for orphans hourly).
    assert f"background response {orphan.pk}: its gateway process stopped" in log_path.read_text()
    world.settled(15)


def test_a_web_process_starts_while_redis_and_the_database_are_down(tmp_path):
    closed = free_port()
    with (tmp_path / "web.log").open("w") as log:
        web = start_gateway(
            f"postgres://postgres@127.0.0.1:{closed}/gpuserve",
            f"redis://127.0.0.1:{closed}/0",
            log=log,
            as_launched=True,
            GATEWAY_BACKGROUND_LEASE_SECONDS=str(LEASE_S),
        )
    try:
        assert web.process.poll() is None  # listening, its startup done
    finally:
        web.stop()
