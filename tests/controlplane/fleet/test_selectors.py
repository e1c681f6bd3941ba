import pytest
from django.utils import timezone

from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.selectors import replicas_ready_for_model, worker_get_by_token
from controlplane.fleet.services import worker_register
from tests.controlplane.factories import DeploymentFactory, ReplicaFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def test_worker_get_by_token():
    result = worker_register(host="h", queue_name="worker.h", gpus=[], at=timezone.now())
    assert worker_get_by_token(token=result.token) == result.worker
    assert worker_get_by_token(token=result.token + "x") is None


def test_replicas_ready_for_model_excludes_other_states_models_and_offline_workers():
    deployment = DeploymentFactory()
    ready = ReplicaFactory(deployment=deployment, state=Replica.State.READY, endpoint_url="http://w1:8001")
    ReplicaFactory(deployment=deployment, state=Replica.State.LOADING)
    ReplicaFactory(
        deployment=deployment, state=Replica.State.READY, endpoint_url="http://w2:8001",
        worker=WorkerFactory(state=Worker.State.OFFLINE),
    )
    ReplicaFactory(state=Replica.State.READY, endpoint_url="http://w3:8001")  # another model
    assert list(replicas_ready_for_model(model=deployment.model)) == [ready]
