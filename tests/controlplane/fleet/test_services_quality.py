"""Where a quality measurement runs: a GPU worker's GPU that holds no replica, else a CPU worker
that has the checkpoint; refused, saying why, when no device is free."""

import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import OperationalError, connection, transaction

from controlplane.fleet.models import QualityMeasurement, Replica, Worker
from controlplane.fleet.services.quality import quality_measurement_request
from tests.controlplane.factories import GpuFactory, ModelFactory, ReplicaFactory, WorkerFactory

pytestmark = pytest.mark.django_db

PATH = "/models/smol"


def _worker(name: str, device: str = Worker.Device.CUDA, gpus: int = 0) -> Worker:
    worker = WorkerFactory(name=name, device=device, model_roots=["/models"], model_paths=[PATH])
    for index in range(gpus):
        GpuFactory(worker=worker, index=index)
    return worker


def _hold(worker: Worker, index: int, size: int = 1) -> None:
    ReplicaFactory(
        worker=worker, gpu=worker.gpus.get(index=index), tensor_parallel_size=size, state=Replica.State.READY
    )


def test_a_gpu_that_holds_no_replica_is_chosen():
    worker = _worker("gpu-a", gpus=4)
    _hold(worker, 0, size=2)  # GPUs 0 and 1
    measurement = quality_measurement_request(model=ModelFactory(weights_path=PATH))
    assert (measurement.worker, measurement.gpu_index) == (worker, 2)


def test_a_busy_gpu_worker_gives_way_to_a_cpu_worker_and_alone_is_refused():
    busy = _worker("gpu-a", gpus=1)
    _hold(busy, 0)
    model = ModelFactory(public_name="smol", weights_path=PATH)
    with pytest.raises(ValidationError, match="Every GPU of gpu-a holds a replica"):
        quality_measurement_request(model=model)
    cpu = _worker("cpu-b", device=Worker.Device.CPU)
    measurement = quality_measurement_request(model=model)
    assert (measurement.worker, measurement.gpu_index) == (cpu, None)


def test_a_measurement_whose_worker_went_away_does_not_block_the_next():
    gone = _worker("cpu-a", device=Worker.Device.CPU)
    model = ModelFactory(public_name="smol", weights_path=PATH)
    first = quality_measurement_request(model=model)
    Worker.objects.filter(pk=gone.pk).update(state=Worker.State.LOST)
    _worker("cpu-b", device=Worker.Device.CPU)
    second = quality_measurement_request(model=model)
    first.refresh_from_db()
    assert (first.state, first.error) == ("failed", "worker cpu-a went away")
    assert second.worker.name == "cpu-b"


@pytest.mark.django_db(transaction=True)
def test_a_gpu_is_not_chosen_while_placement_holds_the_workers(require_postgres):
    """Reconcile counts free GPUs with the online workers locked; a measurement chooses its GPU
    under the same lock, so the two never both take one GPU."""
    worker = _worker("gpu-a", gpus=1)
    model = ModelFactory(public_name="smol", weights_path=PATH)
    locked, release = threading.Event(), threading.Event()

    def place():  # holds the lock reconcile's placement takes, until told to let go
        try:
            with transaction.atomic():
                list(Worker.objects.select_for_update(no_key=True).filter(state=Worker.State.ONLINE))
                locked.set()
                release.wait(timeout=60)
        finally:
            connection.close()

    placing = threading.Thread(target=place)
    placing.start()
    try:
        assert locked.wait(timeout=60)
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '200ms'")
            with pytest.raises(OperationalError, match="lock timeout"):
                quality_measurement_request(model=model)
    finally:
        release.set()
        placing.join(timeout=60)
    assert not QualityMeasurement.objects.exists()
    measurement = quality_measurement_request(model=model)
    assert (measurement.worker, measurement.gpu_index) == (worker, 0)
