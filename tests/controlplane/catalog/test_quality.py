"""The catalog's quality check: a worker's perplexity report recorded on a model, compared with its
base model's, and a deployment's bound on it refusing replicas (reconcile, an operator's scale) with
the reason on the catalog page."""

from __future__ import annotations

import io
import json

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.utils import timezone

from controlplane.catalog.models import Model
from controlplane.catalog.selectors import perplexity_increase, quality_refusal
from controlplane.catalog.services import model_record_perplexity, model_update
from controlplane.fleet.models import PlacementReport, Replica
from controlplane.fleet.reconcile import deployment_reconcile
from controlplane.fleet.services.deployments import deployment_scale, deployment_set_quality_bound
from gpuworker.contract.quality import PerplexityReport
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory
from tests.controlplane.fleet.conftest import make_worker

pytestmark = pytest.mark.django_db

SHA = "ab" * 32


def _report(perplexity: float, quantization: str = "", **changes) -> PerplexityReport:
    fields = {"perplexity": perplexity, "tokens": 510, "window": 256, "text_sha256": SHA, "quantization": quantization}
    return PerplexityReport(**{**fields, **changes})


@pytest.fixture
def pair():
    base = ModelFactory(public_name="llama-8b")
    quantized = ModelFactory(public_name="llama-8b-fp8", quantization=Model.Quantization.FP8, base_model=base)
    return base, quantized


def test_the_increase_is_measured_against_the_base_on_equal_terms(pair):
    base, quantized = pair
    assert perplexity_increase(model=quantized) is None  # neither measured
    model_record_perplexity(model=base, report=_report(20.0))
    quantized = model_record_perplexity(model=quantized, report=_report(20.5, "fp8"))
    assert quantized.perplexity_tokens == 510 and quantized.perplexity_measured_at is not None
    assert perplexity_increase(model=quantized) == pytest.approx(0.025)
    # Another window: not comparable.
    quantized = model_record_perplexity(model=quantized, report=_report(20.5, "fp8", window=512))
    assert perplexity_increase(model=quantized) is None


def test_a_report_of_other_weights_is_refused(pair):
    base, quantized = pair
    with pytest.raises(ValidationError, match="measured fp8 weights but llama-8b serves unquantized"):
        model_record_perplexity(model=base, report=_report(20.0, "fp8"))
    with pytest.raises(ValidationError, match="measured unquantized weights but llama-8b-fp8 serves fp8"):
        model_record_perplexity(model=quantized, report=_report(20.0))
    base.refresh_from_db()
    assert base.perplexity is None


def test_the_base_model_must_be_another_unquantized_model(pair):
    base, quantized = pair
    with pytest.raises(ValidationError, match="must be unquantized"):
        model_update(model=base, base_model=quantized)
    with pytest.raises(ValidationError, match="its own base model"):
        model_update(model=base, base_model=base)


def _gpu_worker():
    return GpuFactory(worker=make_worker(), index=0, memory_total_bytes=80 * 1024**3).worker


def _fresh(deployment):
    return type(deployment).objects.select_related("model__base_model").get(pk=deployment.pk)


def _reconcile(deployment):
    return deployment_reconcile(deployment_id=deployment.pk, now=timezone.now())


def test_a_deployment_bound_refuses_replicas_until_the_model_meets_it(pair):
    base, quantized = pair
    _gpu_worker()
    deployment = DeploymentFactory(model=quantized, desired_replicas=0, max_replicas=2)
    deployment = deployment_set_quality_bound(deployment=deployment, max_perplexity_increase=0.02)
    # Not measured: no scale-up, and reconcile places nothing, saying why.
    with pytest.raises(ValidationError, match="must have its perplexity measured"):
        deployment_scale(deployment=deployment, desired_replicas=1)
    deployment.desired_replicas = 1
    deployment.save()
    outcome = _reconcile(deployment)
    assert outcome.placed == [] and "must have its perplexity measured" in outcome.reason
    assert "perplexity measured" in PlacementReport.objects.get(deployment=deployment).reason
    # Measured, but over the bound.
    model_record_perplexity(model=base, report=_report(20.0))
    model_record_perplexity(model=quantized, report=_report(21.0, "fp8"))
    deployment = _fresh(deployment)
    assert quality_refusal(deployment=deployment) == (
        "llama-8b-fp8's perplexity is 5.00% above its base model's; this deployment allows at most 2.00%"
    )
    assert _reconcile(deployment).placed == []
    # Within the bound: placed.
    deployment_set_quality_bound(deployment=deployment, max_perplexity_increase=0.06)
    assert quality_refusal(deployment=_fresh(deployment)) == ""
    assert len(_reconcile(deployment).placed) == 1
    assert Replica.objects.filter(deployment=deployment).count() == 1


def test_no_bound_no_check_and_a_bad_bound_is_named(pair):
    _, quantized = pair
    deployment = DeploymentFactory(model=quantized, desired_replicas=0, max_replicas=2)
    assert quality_refusal(deployment=deployment) == ""
    deployment_scale(deployment=deployment, desired_replicas=1)
    for bad in (-0.1, "0.02", True, 11):
        with pytest.raises(ValidationError, match="Must be a fraction from 0 to 10"):
            deployment_set_quality_bound(deployment=deployment, max_perplexity_increase=bad)


def test_a_model_without_a_base_cannot_meet_a_bound():
    model = ModelFactory(quantization=Model.Quantization.INT8)
    model = model_record_perplexity(model=model, report=_report(20.0, "int8"))
    deployment = DeploymentFactory(model=model, desired_replicas=0, max_replicas=1, max_perplexity_increase=0.1)
    assert "has no base model" in quality_refusal(deployment=deployment)


def test_the_command_records_a_report_and_names_bad_ones(pair, tmp_path):
    base, quantized = pair
    model_record_perplexity(model=base, report=_report(20.0))
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report(20.4, "fp8").to_json()))
    out = io.StringIO()
    call_command("record_perplexity", "llama-8b-fp8", "--report", str(path), stdout=out)
    assert out.getvalue().strip() == "llama-8b-fp8: perplexity 20.400 over 510 tokens, +2.00% against llama-8b"
    path.write_text(json.dumps({**_report(20.4, "fp8").to_json(), "tokens": 0}))
    with pytest.raises(CommandError, match="Bad report: tokens"):
        call_command("record_perplexity", "llama-8b-fp8", "--report", str(path))
    path.write_text("not json")
    with pytest.raises(CommandError, match="Cannot read the report"):
        call_command("record_perplexity", "llama-8b-fp8", "--report", str(path))
    with pytest.raises(CommandError, match="Unknown model"):
        call_command("record_perplexity", "nope", "--report", str(path))
    path.write_text(json.dumps(_report(20.4).to_json()))
    with pytest.raises(CommandError, match="serves fp8 weights"):
        call_command("record_perplexity", "llama-8b-fp8", "--report", str(path))
