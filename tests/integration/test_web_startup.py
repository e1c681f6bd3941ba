"""The fleet's web server runs as `make run` starts it: its gateway starts with the process (ASGI
lifespan), so a background response whose gateway process died is run again by the web server
before any request reaches it."""

from decimal import Decimal

import pytest

from controlplane.billing.services import credit_grant
from controlplane.gateway.models import StoredResponse
from tests.controlplane.factories import ApiKeyFactory, TenantFactory
from tests.controlplane.gateway.conftest import World, orphaned_background_response
from tests.integration.conftest import wait_until
from tests.integration.test_fleet import _deployment, _online_workers, _ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_web_server_takes_a_dead_process_background_response_over_with_no_request_of_its_own(
    fleet, tiny_model_path
):
    fleet.start_daemon("only")
    _online_workers(fleet, 1)
    deployment = _deployment(tiny_model_path, desired=1, max_replicas=1)
    _ready(deployment, 1, fleet)
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("10"))
    world = World(tenant, ApiKeyFactory(tenant=tenant), deployment.model, [], fleet.url)

    orphan = orphaned_background_response(world)
    # Nothing is sent to the web server: only the gateway its startup built looks for orphans.
    wait_until(
        lambda: StoredResponse.objects.get(pk=orphan.pk).status not in ("queued", "in_progress"),
        timeout=90,
        what=f"background response {orphan.pk} to be run again",
        fleet=fleet,
    )
    done = StoredResponse.objects.get(pk=orphan.pk)
    assert done.status in ("completed", "incomplete") and done.runs == 2, fleet.logs()
    assert done.response["output"]
    web_log = next(p for p in fleet.processes if p.name == "web").log_path.read_text()
    assert f"background response {orphan.pk}: its gateway process stopped" in web_log
