"""Measuring a model's quality from the catalog: the operator presses "Measure quality", a real
worker daemon's agent (registered with Django's live server) takes the MeasureQuality message off
its queue, runs the perplexity command on a tiny checkpoint in a process of its own, and posts the
report to the internal API, which records it on the model; the row shows the figure. Refusals: no
worker has the checkpoint, one measurement at a time, progress for another worker's or an unknown
measurement, and a report of other weights than the model serves."""

import re
import time

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import Model
from controlplane.fleet.models import QualityMeasurement, Worker
from controlplane.fleet.services.quality import quality_measurement_request
from gpuworker.contract.quality import DONE, FAILED, QualityProgress
from gpuworker.contract.tasks import MEASURE_QUALITY, parse_task
from gpuworker.daemon.agent import Agent
from gpuworker.daemon.quality_runs import QualityRuns
from tests.controlplane.dashboard.ops_support import cpu_agent, make_user
from tests.controlplane.factories import ModelFactory
from tests.controlplane.fleet.conftest import queued_tasks
from tests.gpuworker.checkpoints import make_checkpoint

pytestmark = pytest.mark.django_db(transaction=True)

# A small evaluation window keeps the tiny checkpoint's measurement to a few seconds.
WINDOW, MAX_TOKENS = 32, 96


@pytest.fixture
def agent(tmp_path, live_server, settings):
    """A daemon's agent with a tiny float checkpoint under its model root, registered over HTTP."""
    checkpoint = make_checkpoint(tmp_path / "models" / "tiny", "llama")
    agent = cpu_agent(
        control_url=live_server.url,
        token=settings.FLEET_WORKER_TOKEN,
        name="quality-test",
        model_root=tmp_path / "models",
        state_dir=tmp_path / "state",
    )
    agent.quality_runs = QualityRuns(model_roots=agent.config.model_roots, gpu_count=0, report=agent._report_quality)
    try:
        agent._register()
        queued_tasks(Worker.objects.get(name="quality-test").queue_name)  # earlier tests' messages
        agent.checkpoint = checkpoint
        yield agent
    finally:
        agent.quality_runs.close()
        agent._control.close()
        agent.probe.close()


def _deliver(agent: Agent) -> None:
    """The worker's queue, consumed as the daemon's Celery consumer would: each message parsed by
    the contract and handed to the agent."""
    worker = Worker.objects.get(name=agent.config.name)
    for name, kwargs in queued_tasks(worker.queue_name):
        assert name == MEASURE_QUALITY
        agent.measure(parse_task(name, (), kwargs))


def _finished(measurement: QualityMeasurement, timeout: float = 120.0) -> QualityMeasurement:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        measurement.refresh_from_db()
        if measurement.state not in QualityMeasurement.IN_PROGRESS:
            return measurement
        time.sleep(0.1)
    raise AssertionError(f"measurement {measurement.pk} still {measurement.state}")


def _pair(checkpoint) -> tuple[Model, Model]:
    base = ModelFactory(public_name="tiny", weights_path=str(checkpoint))
    fp8 = ModelFactory(
        public_name="tiny-fp8",
        weights_path=str(checkpoint),
        quantization=Model.Quantization.FP8,
        load_quantization=Model.LoadQuantization.FP8,
        base_model=base,
    )
    return base, fp8


def test_the_worker_measures_the_fp8_variant_and_its_base_and_the_catalog_shows_both(client, agent):
    base, fp8 = _pair(agent.checkpoint)
    operator = make_user("operator")
    client.force_login(operator)
    for model in (base, fp8):
        row = client.post(reverse("dashboard:catalog_measure_quality", args=[model.pk]), HTTP_HX_REQUEST="true")
        assert 'data-state="queued"' in row.content.decode() and 'hx-trigger="every 3s"' in row.content.decode()
    assert AuditEntry.objects.filter(action=AuditEntry.Action.MODEL_MEASURE_QUALITY, actor=operator).count() == 2
    # The page's button measures the whole text; here the same service measures a short window of it.
    QualityMeasurement.objects.all().delete()
    queued_tasks(Worker.objects.get(name="quality-test").queue_name)  # the button's messages
    measurements = [
        quality_measurement_request(model=model, window=WINDOW, max_tokens=MAX_TOKENS) for model in (base, fp8)
    ]
    _deliver(agent)
    for measurement in measurements:
        assert _finished(measurement).state == QualityMeasurement.State.DONE, measurement.error
    base.refresh_from_db()
    fp8.refresh_from_db()
    assert base.perplexity > 1 and fp8.perplexity > 1 and fp8.perplexity != base.perplexity
    assert (fp8.perplexity_window, fp8.perplexity_tokens) == (WINDOW, MAX_TOKENS - MAX_TOKENS // WINDOW)
    page = client.get(reverse("dashboard:catalog")).content.decode()
    fp8_row = page[page.index('data-model="tiny-fp8"') :]
    shown = re.search(r"Perplexity ([0-9.]+)", fp8_row).group(1)
    assert float(shown) == pytest.approx(fp8.perplexity, abs=1e-3)
    assert 'data-testid="model-perplexity-increase"' in fp8_row and "vs tiny" in fp8_row
    assert 'data-state="done"' in fp8_row and "every 3s" not in fp8_row.split("</tr>")[0]


def test_a_path_outside_the_workers_roots_fails_with_the_workers_reason(agent, tmp_path):
    model = ModelFactory(public_name="tiny", weights_path=str(agent.checkpoint))
    measurement = quality_measurement_request(model=model)
    worker = Worker.objects.get(name="quality-test")
    [(name, kwargs)] = queued_tasks(worker.queue_name)
    agent.measure(parse_task(name, (), {**kwargs, "model_path": str(tmp_path / "elsewhere")}))
    failed = _finished(measurement)
    assert failed.state == QualityMeasurement.State.FAILED
    assert "lies outside this worker's model roots" in failed.error
    model.refresh_from_db()
    assert model.perplexity is None


def test_a_measurement_is_refused_without_a_worker_that_has_the_checkpoint_and_while_one_runs(agent, tmp_path):
    missing = ModelFactory(public_name="missing", weights_path=str(tmp_path / "models" / "absent"))
    with pytest.raises(ValidationError, match="No online worker reports the checkpoint at"):
        quality_measurement_request(model=missing)
    model = ModelFactory(public_name="tiny", weights_path=str(agent.checkpoint))
    quality_measurement_request(model=model)
    with pytest.raises(ValidationError, match="tiny is already being measured on quality-test"):
        quality_measurement_request(model=model)
    assert QualityMeasurement.objects.count() == 1


def _post(client, settings, worker_id: int, measurement_id: int, body: dict):
    return client.post(
        reverse("fleet_internal:quality", args=[worker_id, measurement_id]),
        body,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {settings.FLEET_WORKER_TOKEN}",
    )


REPORT = {"perplexity": 12.5, "tokens": 93, "window": 32, "text_sha256": "a" * 64}


def test_progress_for_an_unknown_or_other_workers_measurement_or_of_other_weights_is_refused(client, settings, agent):
    _, fp8 = _pair(agent.checkpoint)
    measurement = quality_measurement_request(model=fp8)
    worker_id = measurement.worker_id
    assert _post(client, settings, worker_id, measurement.pk + 1, {"state": "running"}).status_code == 404
    assert _post(client, settings, worker_id + 1, measurement.pk, {"state": "running"}).status_code == 404
    bad = _post(client, settings, worker_id, measurement.pk, {"state": FAILED})
    assert bad.status_code == 400 and "must say why" in bad.json()["fields"]["error"][0]
    # A float report for a model that serves FP8: refused, and the measurement fails saying why.
    other = _post(
        client, settings, worker_id, measurement.pk, QualityProgress(state=DONE).to_json() | {"report": REPORT}
    )
    assert other.status_code == 400
    assert "measured unquantized weights but tiny-fp8 serves fp8 weights" in other.json()["fields"]["quantization"][0]
    measurement.refresh_from_db()
    fp8.refresh_from_db()
    assert measurement.state == QualityMeasurement.State.FAILED and "serves fp8 weights" in measurement.error
    assert fp8.perplexity is None
    again = _post(
        client, settings, worker_id, measurement.pk, {"state": DONE, "report": {**REPORT, "quantization": "fp8"}}
    )
    assert again.status_code == 400 and "already failed" in again.json()["fields"]["state"][0]


def test_a_worker_that_registers_again_fails_the_measurements_it_had_in_progress(agent):
    model = ModelFactory(public_name="tiny", weights_path=str(agent.checkpoint))
    measurement = quality_measurement_request(model=model)
    agent._register()  # as a restarted daemon does: it runs none of the old ones
    measurement.refresh_from_db()
    assert measurement.state == QualityMeasurement.State.FAILED and "restarted before it finished" in measurement.error
    assert quality_measurement_request(model=model).state == QualityMeasurement.State.QUEUED


def test_a_measurement_that_fails_on_the_worker_says_why(agent):
    """A window longer than the checkpoint's context: the command's own error comes back."""
    model = ModelFactory(public_name="tiny", weights_path=str(agent.checkpoint))
    measurement = quality_measurement_request(model=model, window=4096)
    _deliver(agent)
    failed = _finished(measurement)
    assert failed.state == QualityMeasurement.State.FAILED
    assert "the perplexity command exited with status 2" in failed.error
    assert "max_model_len (4096) exceeds the model's context" in failed.error
