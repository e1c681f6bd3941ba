"""The catalog pages: add and edit models with every error beside its field, the weight path
checked against what the chosen workers report (inside their model roots, a checkpoint there),
enable, disable and deploy, each audited."""

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import Deployment, Model
from controlplane.catalog.services import model_record_perplexity
from controlplane.fleet.models import Worker
from controlplane.fleet.services.heartbeats import worker_heartbeat
from controlplane.fleet.services.workers import worker_register
from gpuworker.contract.heartbeat import parse_heartbeat, parse_registration
from gpuworker.contract.quality import PerplexityReport
from tests.controlplane.dashboard.ops_support import (  # noqa: F401 (fixtures)
    _private_live_cache,
    make_worker,
)
from tests.controlplane.factories import DeploymentFactory, ModelFactory, PriceTierFactory

pytestmark = pytest.mark.django_db


def _form(**overrides) -> dict:
    return {
        "public_name": "llama-3-8b",
        "family": "llama",
        "kind": "chat",
        "weights_path": "/models/llama-3-8b",
        "context_length": "8192",
        "parameter_count": "8000000000",
        "gpu_memory_bytes": "",
        "tensor_parallel_size": "1",
        "price_tier": str(PriceTierFactory().pk),
        "enabled": "on",
        **overrides,
    }


def _reporting_worker(name: str, *, roots: list[str], paths: list[str], quantization: dict | None = None) -> Worker:
    """A worker registered through the service, reporting its model roots like the daemon does."""
    return worker_register(
        registration=parse_registration(
            {
                "name": name,
                "advertise_host": "10.0.0.5",
                "device": "cpu",
                "gpus": [],
                "cpu": {"memory_total_bytes": 1 << 34, "cores": 8},
                "models": {"roots": roots, "paths": paths, "quantization": quantization or {}},
            }
        ),
        now=timezone.now(),
    )


def _error_beside(page: str, field: str) -> str:
    start = page.index(f'id="errors-{field}"')
    assert page.index(f'name="{field}"') < start  # the message follows its own input
    return page[start : page.index("</div>", start)]


def test_adding_a_model_estimates_its_memory_and_is_audited(operator_client, operator):
    response = operator_client.post(reverse("dashboard:catalog_add"), _form(check_workers=[]), follow=True)
    assert response.redirect_chain[-1][0] == reverse("dashboard:catalog")
    page = response.content.decode()
    assert "Added llama-3-8b." in page and "The weight path was not checked: no worker was chosen." in page
    model = Model.objects.get(public_name="llama-3-8b")
    assert model.gpu_memory_bytes == int(8_000_000_000 * 2 * 1.2)
    entry = AuditEntry.objects.get(action="model.create")
    assert (entry.actor, entry.detail["weights_path"]) == (operator, "/models/llama-3-8b")


def test_a_quantized_model_is_estimated_smaller_and_shown(operator_client):
    response = operator_client.post(
        reverse("dashboard:catalog_add"), _form(quantization="awq-int4", check_workers=[]), follow=True
    )
    model = Model.objects.get(public_name="llama-3-8b")
    assert model.quantization == "awq-int4"
    # INT4 projections and bf16 embeddings: under half of bf16's estimate.
    assert model.gpu_memory_bytes < int(8_000_000_000 * 2 * 1.2) / 2
    assert 'data-testid="model-quantization">AWQ INT4<' in response.content.decode()


def test_a_model_split_over_several_gpus_records_and_shows_it(operator_client, operator):
    response = operator_client.post(
        reverse("dashboard:catalog_add"), _form(tensor_parallel_size="2", check_workers=[]), follow=True
    )
    assert Model.objects.get(public_name="llama-3-8b").tensor_parallel_size == 2
    assert 'data-testid="model-tensor-parallel">2 GPUs per replica<' in response.content.decode()
    assert AuditEntry.objects.get(action="model.create").detail["tensor_parallel_size"] == 2


def test_a_split_moe_model_records_how_its_experts_are_joined(operator_client):
    operator_client.post(
        reverse("dashboard:catalog_add"),
        _form(tensor_parallel_size="2", expert_parallel="all_to_all", check_workers=[]),
    )
    assert Model.objects.get(public_name="llama-3-8b").expert_parallel == "all_to_all"
    operator_client.post(reverse("dashboard:catalog_add"), _form(public_name="other", check_workers=[]))
    assert Model.objects.get(public_name="other").expert_parallel == "all_reduce"  # left empty: the default


def test_the_add_form_detects_the_quantization_the_checked_worker_reports(operator_client):
    worker = _reporting_worker(
        "gpu-a", roots=["/models"], paths=["/models/llama-3-8b"], quantization={"/models/llama-3-8b": "fp8"}
    )
    operator_client.post(reverse("dashboard:catalog_add"), _form(quantization="detect", check_workers=[worker.pk]))
    model = Model.objects.get(public_name="llama-3-8b")
    assert model.quantization == "fp8"
    assert model.gpu_memory_bytes < int(8_000_000_000 * 2 * 1.2) * 0.65


def test_fp8_at_load_of_a_float_checkpoint_serves_fp8_and_is_estimated_and_shown_so(operator_client):
    worker = _reporting_worker("gpu-a", roots=["/models"], paths=["/models/llama-3-8b"])
    page = operator_client.post(
        reverse("dashboard:catalog_add"),
        _form(quantization="detect", load_quantization="fp8", check_workers=[worker.pk]),
        follow=True,
    ).content.decode()
    model = Model.objects.get(public_name="llama-3-8b")
    assert (model.quantization, model.load_quantization) == ("fp8", "fp8")
    assert model.gpu_memory_bytes < int(8_000_000_000 * 2 * 1.2) * 0.65
    assert 'data-testid="model-quantization">FP8 at load<' in page


def test_fp8_at_load_of_an_already_quantized_checkpoint_is_refused_beside_the_field(operator_client):
    worker = _reporting_worker(
        "gpu-a", roots=["/models"], paths=["/models/llama-3-8b"], quantization={"/models/llama-3-8b": "awq-int4"}
    )
    response = operator_client.post(
        reverse("dashboard:catalog_add"),
        _form(quantization="detect", load_quantization="fp8", check_workers=[worker.pk]),
    )
    error = _error_beside(response.content.decode(), "load_quantization")
    assert "already quantized (awq-int4): only a float checkpoint can be quantized at load" in error
    assert not Model.objects.exists() and not AuditEntry.objects.exists()


def test_fp8_at_load_with_another_quantization_named_is_refused_beside_the_field(operator_client):
    response = operator_client.post(
        reverse("dashboard:catalog_add"), _form(quantization="gptq-int4", load_quantization="fp8", check_workers=[])
    )
    error = _error_beside(response.content.decode(), "load_quantization")
    assert "the quantization must be FP8, not GPTQ INT4" in error
    assert not Model.objects.exists()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("quantization", "int3", "Select a valid choice."),
        ("public_name", "bad name!", "Use letters, digits and . _ : / - only"),
        ("public_name", "", "This field is required."),
        ("weights_path", "models/relative", "Give an absolute path"),
        ("context_length", "0", "Ensure this value is greater than or equal to 1."),
        ("parameter_count", "lots", "Enter a whole number."),
        ("kind", "poem", "Select a valid choice."),
        ("gpu_memory_bytes", "-5", "Ensure this value is greater than or equal to 1."),
        ("tensor_parallel_size", "0", "Ensure this value is greater than or equal to 1."),
        ("tensor_parallel_size", "17", "Ensure this value is less than or equal to 16."),
        ("expert_parallel", "alltoall", "Select a valid choice."),
        ("load_quantization", "int4", "Select a valid choice."),
    ],
)
def test_bad_input_is_refused_beside_the_field(operator_client, field, value, message):
    response = operator_client.post(reverse("dashboard:catalog_add"), _form(**{field: value}))
    assert response.status_code == 200
    assert message in _error_beside(response.content.decode(), field)
    assert not Model.objects.exists() and not AuditEntry.objects.exists()


def test_a_duplicate_name_is_refused_beside_the_name(operator_client):
    ModelFactory(public_name="llama-3-8b")
    page = operator_client.post(reverse("dashboard:catalog_add"), _form()).content.decode()
    assert "Model with this Public name already exists." in _error_beside(page, "public_name")


def test_the_path_must_exist_on_chosen_workers_that_search_there(operator_client):
    has_it = _reporting_worker("has-it", roots=["/models"], paths=["/models/llama-3-8b"])
    lacks_it = _reporting_worker("lacks-it", roots=["/models"], paths=["/models/other"])
    page = operator_client.post(
        reverse("dashboard:catalog_add"), _form(check_workers=[has_it.pk, lacks_it.pk])
    ).content.decode()
    error = _error_beside(page, "weights_path")
    assert "lacks-it has no checkpoint (a directory with config.json or a .gguf file) at /models/llama-3-8b" in error
    assert "has-it" not in error
    assert not Model.objects.exists()
    response = operator_client.post(reverse("dashboard:catalog_add"), _form(check_workers=[has_it.pk]), follow=True)
    assert "Added llama-3-8b." in response.content.decode()
    assert Model.objects.filter(public_name="llama-3-8b").exists()


def test_a_path_outside_a_chosen_workers_model_roots_is_refused_naming_the_roots(operator_client):
    silent = make_worker(name="silent")  # reports no model roots: it loads nothing
    elsewhere = _reporting_worker("elsewhere", roots=["/data/models"], paths=[])
    page = operator_client.post(
        reverse("dashboard:catalog_add"), _form(check_workers=[silent.pk, elsewhere.pk])
    ).content.decode()
    error = _error_beside(page, "weights_path")
    assert "silent reports no model roots, so it loads no model: start its daemon with --model-root DIR" in error
    assert (
        "/models/llama-3-8b lies outside elsewhere&#x27;s model roots (/data/models), so it refuses to load it" in error
    )
    assert not Model.objects.exists()


def test_a_path_escaping_a_model_root_with_dotdot_is_refused(operator_client):
    worker = _reporting_worker("w1", roots=["/data/models"], paths=[])
    escaping = "/data/models/../elsewhere/llama"
    page = operator_client.post(
        reverse("dashboard:catalog_add"), _form(weights_path=escaping, check_workers=[worker.pk])
    ).content.decode()
    assert f"{escaping} contains &#x27;..&#x27;: give the checkpoint&#x27;s own path" in _error_beside(
        page, "weights_path"
    )
    query = {"weights_path": escaping, "check_workers": [worker.pk]}
    check = operator_client.get(reverse("dashboard:catalog_path_check"), query).content.decode()
    assert 'data-status="outside"' in check and "/data/elsewhere/llama lies outside w1&#x27;s model roots" in check
    assert not Model.objects.exists()


def test_heartbeats_update_what_a_worker_reports(operator_client):
    worker = _reporting_worker("w1", roots=["/models"], paths=[])
    url = reverse("dashboard:catalog_path_check")
    query = {"weights_path": "/models/new", "check_workers": [worker.pk]}
    assert 'data-status="missing"' in operator_client.get(url, query).content.decode()
    worker_heartbeat(
        worker_id=worker.pk,
        now=timezone.now(),
        heartbeat=parse_heartbeat({"models": {"roots": ["/models"], "paths": ["/models/new"]}}),
    )
    assert 'data-status="found"' in operator_client.get(url, query).content.decode()


def test_the_add_form_offers_online_workers_checked_by_default(operator_client):
    online, lost = make_worker(name="on-1"), make_worker(name="lost-1", state=Worker.State.LOST)
    make_worker(name="gone-1", state=Worker.State.OFFLINE)
    page = operator_client.get(reverse("dashboard:catalog_add")).content.decode()
    assert f'value="{online.pk}"' in page and f'value="{lost.pk}"' in page and "gone-1" not in page
    checked = page[page.index(f'value="{online.pk}"') - 200 : page.index(f'value="{online.pk}"') + 80]
    assert "checked" in checked


def test_editing_a_model_records_what_changed(operator_client, operator):
    model = ModelFactory(public_name="qwen", context_length=4096)
    form = {
        **_form(
            public_name="qwen",
            weights_path=model.weights_path,
            context_length="32768",
            price_tier=str(model.price_tier_id),
            gpu_memory_bytes=str(model.gpu_memory_bytes),
            parameter_count=str(model.parameter_count),
            family=model.family,
        )
    }
    response = operator_client.post(reverse("dashboard:catalog_edit", args=[model.pk]), form, follow=True)
    assert "Saved qwen." in response.content.decode()
    model.refresh_from_db()
    assert model.context_length == 32768
    assert AuditEntry.objects.get(action="model.update").detail == {"context_length": [4096, 32768]}
    page = operator_client.post(
        reverse("dashboard:catalog_edit", args=[model.pk]), {**form, "context_length": "-3"}
    ).content.decode()
    assert "greater than or equal to 1" in _error_beside(page, "context_length")


def test_the_served_context_is_set_on_the_edit_form_and_shown_in_the_list(operator_client):
    model = ModelFactory(public_name="qwen", context_length=32768)
    edit = reverse("dashboard:catalog_edit", args=[model.pk])
    page = operator_client.get(edit).content.decode()
    assert 'name="max_model_len"' in page and 'name="allow_long_context"' in page
    form = _form(
        public_name="qwen",
        weights_path=model.weights_path,
        context_length="32768",
        price_tier=str(model.price_tier_id),
        gpu_memory_bytes=str(model.gpu_memory_bytes),
        parameter_count=str(model.parameter_count),
        family=model.family,
        max_model_len="131072",
    )
    page = operator_client.post(edit, form).content.decode()
    assert "past the checkpoint&#x27;s context of 32768: allow long context" in _error_beside(page, "max_model_len")
    page = operator_client.post(edit, {**form, "max_model_len": "5000000"}).content.decode()
    assert "less than or equal to 4194304" in _error_beside(page, "max_model_len")
    assert Model.objects.get(pk=model.pk).max_model_len is None
    page = operator_client.post(edit, {**form, "allow_long_context": "on"}, follow=True).content.decode()
    model.refresh_from_db()
    assert (model.max_model_len, model.allow_long_context) == (131072, True)
    assert AuditEntry.objects.get(action="model.update").detail == {
        "max_model_len": [None, 131072],
        "allow_long_context": [False, True],
    }
    row = page[page.index(f'id="model-{model.pk}"') :]
    assert 'data-testid="model-context">131072<' in row
    assert 'data-testid="model-context-note">checkpoint 32768, long context allowed<' in row


def test_a_vision_models_image_limits_are_set_on_the_edit_form_and_audited(operator_client):
    model = ModelFactory(public_name="qwen-vl", kind=Model.Kind.VISION, context_length=32768)
    edit = reverse("dashboard:catalog_edit", args=[model.pk])
    page = operator_client.get(edit).content.decode()
    limits = page[page.index('id="image-limits"') :]
    assert "Images (vision models)" in limits
    for name, label in [
        ("max_images_per_request", "Images per request"),
        ("max_image_bytes", "Largest image (bytes)"),
        ("max_image_pixels", "Most pixels an image"),
        ("low_detail_pixels", "Low-detail pixels"),
    ]:
        assert f'name="{name}"' in limits and label in limits
    assert 'name="max_images_per_request" value="16"' in limits
    form = _form(
        public_name="qwen-vl",
        kind="vision",
        weights_path=model.weights_path,
        context_length="32768",
        price_tier=str(model.price_tier_id),
        gpu_memory_bytes=str(model.gpu_memory_bytes),
        parameter_count=str(model.parameter_count),
        family=model.family,
        max_images_per_request="4",
        max_image_bytes=str(5 << 20),
    )
    page = operator_client.post(edit, {**form, "max_images_per_request": "300"}).content.decode()
    assert "less than or equal to 256" in _error_beside(page, "max_images_per_request")
    page = operator_client.post(edit, {**form, "max_image_pixels": "0"}).content.decode()
    assert "greater than or equal to 1" in _error_beside(page, "max_image_pixels")
    assert Model.objects.get(pk=model.pk).max_images_per_request == 16 and not AuditEntry.objects.exists()
    operator_client.post(edit, form, follow=True)
    model.refresh_from_db()
    # The limits left empty keep their values.
    assert (model.max_images_per_request, model.max_image_bytes, model.max_image_pixels) == (4, 5 << 20, 8192 * 8192)
    assert AuditEntry.objects.get(action="model.update").detail == {
        "max_images_per_request": [16, 4],
        "max_image_bytes": [20 << 20, 5 << 20],
    }


def test_enable_disable_and_deploy_from_the_list(operator_client, operator, django_capture_on_commit_callbacks):
    model = ModelFactory(public_name="phi", enabled=True)
    page = operator_client.get(reverse("dashboard:catalog")).content.decode()
    assert f'id="model-{model.pk}"' in page and 'hx-confirm="Disable phi?' in page
    fragment = operator_client.post(
        reverse("dashboard:catalog_set_enabled", args=[model.pk]), {"enabled": "0"}, HTTP_HX_REQUEST="true"
    ).content.decode()
    assert fragment.lstrip().startswith(f'<tr id="model-{model.pk}"') and 'data-enabled="false"' in fragment
    model.refresh_from_db()
    assert not model.enabled
    operator_client.post(
        reverse("dashboard:catalog_set_enabled", args=[model.pk]), {"enabled": "1"}, HTTP_HX_REQUEST="true"
    )
    with django_capture_on_commit_callbacks(execute=True):
        fragment = operator_client.post(
            reverse("dashboard:catalog_deploy", args=[model.pk]), HTTP_HX_REQUEST="true"
        ).content.decode()
    assert "1 replica wanted" in fragment and 'data-testid="catalog-deploy"' not in fragment
    assert Deployment.objects.get(model=model).desired_replicas == 1
    assert list(AuditEntry.objects.order_by("pk").values_list("action", "actor_label")) == [
        ("model.disable", operator.username),
        ("model.enable", operator.username),
        ("deployment.create", operator.username),
    ]


def test_the_empty_catalog_says_what_to_do(operator_client):
    page = operator_client.get(reverse("dashboard:catalog")).content.decode()
    assert 'data-testid="catalog-empty"' in page and reverse("dashboard:catalog_add") in page


def test_delete_from_the_list_removes_the_row_and_is_audited(operator_client, operator):
    model = ModelFactory(public_name="typo-model")
    page = operator_client.get(reverse("dashboard:catalog")).content.decode()
    assert 'hx-confirm="Delete typo-model from the catalog?' in page
    assert operator_client.get(reverse("dashboard:catalog_delete", args=[model.pk])).status_code == 405
    response = operator_client.post(reverse("dashboard:catalog_delete", args=[model.pk]), HTTP_HX_REQUEST="true")
    assert response.status_code == 200 and response.content.decode() == ""
    assert not Model.objects.filter(pk=model.pk).exists()
    assert AuditEntry.objects.get(action="model.delete").actor == operator


def test_delete_of_a_model_with_a_running_replica_says_why_beside_the_button(operator_client):
    from controlplane.fleet.models import Replica
    from tests.controlplane.factories import DeploymentFactory, ReplicaFactory

    deployment = DeploymentFactory(model=ModelFactory(public_name="busy"))
    ReplicaFactory(deployment=deployment, worker=make_worker(), state=Replica.State.READY)
    fragment = operator_client.post(
        reverse("dashboard:catalog_delete", args=[deployment.model.pk]), HTTP_HX_REQUEST="true"
    ).content.decode()
    assert fragment.lstrip().startswith(f'<tr id="model-{deployment.model.pk}"')
    assert 'data-testid="action-error"' in fragment and "busy still has 1 replica" in fragment
    # Without JavaScript: back to the catalog, the refusal as the page's message.
    response = operator_client.post(reverse("dashboard:catalog_delete", args=[deployment.model.pk]), follow=True)
    assert "busy still has 1 replica" in response.content.decode()
    assert Model.objects.filter(pk=deployment.model.pk).exists()


@pytest.mark.parametrize(("role", "status"), [("tenant_member", 403), ("anonymous", 302)])
def test_delete_is_for_operators_only(client, role, status):
    from tests.controlplane.dashboard.ops_support import make_user

    model = ModelFactory()
    if role != "anonymous":
        client.force_login(make_user(role))
    response = client.post(reverse("dashboard:catalog_delete", args=[model.pk]))
    assert response.status_code == status and Model.objects.filter(pk=model.pk).exists()


def test_disabling_from_the_list_says_the_replicas_unload(operator_client):
    from tests.controlplane.factories import DeploymentFactory

    deployment = DeploymentFactory(model=ModelFactory(public_name="phi"), desired_replicas=1)
    response = operator_client.post(
        reverse("dashboard:catalog_set_enabled", args=[deployment.model.pk]), {"enabled": "0"}, follow=True
    )
    page = response.content.decode()
    assert "phi disabled: its replicas unload." in page and "none loaded while disabled" in page


def test_the_catalog_shows_perplexity_its_increase_and_a_quality_refusal(operator_client):
    base = ModelFactory(public_name="smollm2")
    fp8 = ModelFactory(public_name="smollm2-fp8", quantization=Model.Quantization.FP8, base_model=base)
    int8 = ModelFactory(public_name="smollm2-int8", quantization=Model.Quantization.INT8, base_model=base)
    DeploymentFactory(model=int8, desired_replicas=0, max_replicas=1, max_perplexity_increase=0.02)
    terms = {"tokens": 510, "window": 256, "text_sha256": "ab" * 32}
    model_record_perplexity(model=base, report=PerplexityReport(perplexity=24.832, **terms))
    model_record_perplexity(model=fp8, report=PerplexityReport(perplexity=25.975, quantization="fp8", **terms))
    page = operator_client.get(reverse("dashboard:catalog")).content.decode()
    assert 'data-testid="model-perplexity-increase">+4.60% vs smollm2<' in page
    assert "Perplexity 25.975" in page and "Perplexity 24.832" in page
    assert "Perplexity not measured" in page  # the INT8 model
    assert "smollm2-int8 must have its perplexity measured before it serves" in page
