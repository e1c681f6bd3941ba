"""A fleet that heals itself (issue 19): a load that failed once is retried with backoff by the
control plane on its own, across a restart of the control plane, with no operator action."""

import shutil
import uuid

import pytest

from controlplane.fleet.models import LoadBackoff, Replica
from controlplane.fleet.selectors import deployment_statuses
from controlplane.fleet.services.deployments import deployment_scale
from tests.integration.conftest import wait_until
from tests.integration.test_fleet import _deployment, _online_workers, _ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_failed_load_followed_by_a_control_plane_restart_serves_again_unattended(fleet, tiny_model_path):
    fleet.start_daemon("only")
    [worker] = _online_workers(fleet, 1)
    # The checkpoint appears only after the first attempt (a disk still mounting, a copy still
    # running): the first load fails on the only worker there is.
    late = tiny_model_path.parent / f"late-{uuid.uuid4().hex[:8]}"
    deployment = _deployment(late, max_replicas=1)
    deployment_scale(deployment=deployment, desired_replicas=1, actor=None)
    failed = wait_until(
        lambda: Replica.objects.filter(deployment=deployment, failure=Replica.Failure.LOAD).first(),
        timeout=90,
        what="the first load to fail",
        fleet=fleet,
    )
    assert failed.worker_id == worker.pk
    backoff = LoadBackoff.objects.get(deployment=deployment, worker=worker)
    assert backoff.consecutive_failures >= 1 and str(late) in backoff.last_error

    fleet.stop_control_plane()
    shutil.copytree(tiny_model_path, late)
    fleet.start_control_plane(mode="ab")

    [replica] = _ready(deployment, 1, fleet)
    assert replica.worker_id == worker.pk
    assert not LoadBackoff.objects.filter(deployment=deployment).exists()
    [status] = deployment_statuses(deployment_ids=[deployment.pk])
    assert status.state == "ready"
