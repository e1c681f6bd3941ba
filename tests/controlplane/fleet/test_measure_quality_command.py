"""`manage.py measure_quality`: what `make run` uses to measure the demo's SmolLM2 and its FP8 twin once."""

import io

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from controlplane.fleet.models import QualityMeasurement
from controlplane.fleet.services.workers import worker_register
from gpuworker.contract.heartbeat import parse_registration
from tests.controlplane.factories import ModelFactory
from tests.controlplane.fleet.conftest import queued_tasks

pytestmark = pytest.mark.django_db


def _run(*args: str) -> str:
    out = io.StringIO()
    call_command("measure_quality", *args, stdout=out)
    return out.getvalue()


def _worker_with(path: str):
    return worker_register(
        registration=parse_registration(
            {
                "name": "cpu-quality",
                "advertise_host": "10.0.0.5",
                "device": "cpu",
                "gpus": [],
                "cpu": {"memory_total_bytes": 1 << 34, "cores": 8},
                "models": {"roots": ["/models"], "paths": [path], "quantization": {}},
            }
        ),
        now=timezone.now(),
    )


def test_each_model_is_measured_once_on_a_worker_that_has_it(django_capture_on_commit_callbacks):
    base = ModelFactory(public_name="smol", weights_path="/models/smol")
    fp8 = ModelFactory(
        public_name="smol-fp8",
        weights_path="/models/smol",
        quantization="fp8",
        load_quantization="fp8",
        base_model=base,
    )
    worker = _worker_with("/models/smol")
    queued_tasks(worker.queue_name)
    with django_capture_on_commit_callbacks(execute=True):
        out = _run("--unmeasured", "smol", "smol-fp8")
    assert out.splitlines() == ["smol: measuring on cpu-quality (CPU)", "smol-fp8: measuring on cpu-quality (CPU)"]
    sent = {kwargs["measurement_id"]: kwargs for _, kwargs in queued_tasks(worker.queue_name)}
    assert {kwargs["quantization"] for kwargs in sent.values()} == {"", "fp8"}
    assert all(kwargs["gpu_index"] is None for kwargs in sent.values())
    again = _run("--unmeasured", "smol", "smol-fp8")  # a second `make run`
    assert again.count("already measured or being measured; skipped") == 2
    assert QualityMeasurement.objects.filter(model=fp8).count() == 1


def test_a_model_whose_measurement_was_cut_short_by_a_restart_is_measured_again(django_capture_on_commit_callbacks):
    """`make run` stopped with Ctrl-C mid-measurement: the daemon registers again on the next start,
    which fails the measurement it had; that run asks again rather than skipping the model."""
    ModelFactory(public_name="smol", weights_path="/models/smol")
    _worker_with("/models/smol")
    with django_capture_on_commit_callbacks(execute=True):
        _run("--unmeasured", "smol")
    _worker_with("/models/smol")  # the next `make run`: the same daemon registers again
    assert QualityMeasurement.objects.get().state == QualityMeasurement.State.FAILED
    with django_capture_on_commit_callbacks(execute=True):
        out = _run("--unmeasured", "smol")
    assert out.splitlines() == ["smol: measuring on cpu-quality (CPU)"]
    assert [m.state for m in QualityMeasurement.objects.all()] == [
        QualityMeasurement.State.QUEUED,
        QualityMeasurement.State.FAILED,
    ]


def test_an_unknown_model_or_one_no_worker_has_is_refused_saying_why():
    with pytest.raises(CommandError, match="Unknown model 'nope'"):
        _run("nope")
    ModelFactory(public_name="smol", weights_path="/models/smol")
    with pytest.raises(CommandError, match="smol: No online worker reports the checkpoint at /models/smol"):
        _run("smol")
    assert not QualityMeasurement.objects.exists()
