import pytest
from django.core.exceptions import ValidationError

from controlplane.catalog.models import Deployment, Model
from controlplane.catalog.services import (
    deployment_create,
    deployment_scale,
    estimate_gpu_memory_bytes,
    model_create,
    model_set_enabled,
)
from tests.controlplane.factories import DeploymentFactory, ModelFactory, PriceTierFactory

pytestmark = pytest.mark.django_db


def _model_fields(**overrides):
    fields = dict(
        public_name="llama-3-8b-instruct",
        family="llama",
        kind=Model.Kind.CHAT,
        weights_path="/models/llama-3-8b-instruct",
        context_length=8192,
        parameter_count=8_030_000_000,
        price_tier=PriceTierFactory(),
    )
    return {**fields, **overrides}


def test_model_create_estimates_gpu_memory_when_not_given():
    model = model_create(**_model_fields())
    assert model.gpu_memory_bytes == estimate_gpu_memory_bytes(parameter_count=8_030_000_000)
    # bf16 weights alone are 2 bytes per parameter; the estimate must leave room beyond them.
    assert model.gpu_memory_bytes > 2 * 8_030_000_000


def test_model_create_keeps_a_given_memory_figure():
    model = model_create(**_model_fields(gpu_memory_bytes=20 * 1024**3))
    assert Model.objects.get(pk=model.pk).gpu_memory_bytes == 20 * 1024**3


def test_duplicate_public_name_raises_and_writes_nothing():
    model_create(**_model_fields())
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(family="other"))
    assert "public_name" in error.value.message_dict
    assert Model.objects.count() == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("public_name", "has space"),
        ("public_name", "-leading-dash"),
        ("public_name", ""),
        ("kind", "image"),
        ("context_length", 0),
        ("context_length", -1),
        ("parameter_count", 0),
        ("gpu_memory_bytes", 0),
        ("weights_path", ""),
        ("family", ""),
    ],
)
def test_invalid_model_fields_raise_naming_the_field(field, value):
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(**{field: value}))
    assert field in error.value.message_dict
    assert not Model.objects.exists()


def test_model_set_enabled():
    model = ModelFactory()
    model_set_enabled(model=model, enabled=False)
    assert not Model.objects.get(pk=model.pk).enabled


def test_deployment_create():
    model = ModelFactory()
    deployment = deployment_create(model_name=model.public_name, desired_replicas=2, min_replicas=1, max_replicas=4)
    deployment.refresh_from_db()
    assert (deployment.model, deployment.desired_replicas, deployment.min_replicas, deployment.max_replicas) == (
        model, 2, 1, 4,
    )


def test_deployment_of_unknown_model_raises_and_writes_nothing():
    ModelFactory(public_name="known")
    with pytest.raises(ValidationError) as error:
        deployment_create(model_name="unknown")
    assert "unknown" in str(error.value.message_dict["model"])
    assert not Deployment.objects.exists()


@pytest.mark.parametrize(
    ("desired", "low", "high", "field"),
    [
        (-1, 0, 1, "desired_replicas"),
        (1, -1, 1, "min_replicas"),
        (1, 0, -2, "max_replicas"),
        (3, 0, 2, "__all__"),  # desired above max
        (0, 1, 2, "__all__"),  # desired below min
        (2, 3, 2, "__all__"),  # min above max
    ],
)
def test_invalid_replica_counts_raise_and_write_nothing(desired, low, high, field):
    model = ModelFactory()
    with pytest.raises(ValidationError) as error:
        deployment_create(model_name=model.public_name, desired_replicas=desired, min_replicas=low, max_replicas=high)
    assert field in error.value.message_dict
    assert not Deployment.objects.exists()


def test_a_model_has_at_most_one_deployment():
    deployment = DeploymentFactory()
    with pytest.raises(ValidationError) as error:
        deployment_create(model_name=deployment.model.public_name)
    assert "model" in error.value.message_dict
    assert Deployment.objects.count() == 1


def test_deployment_scale_within_bounds():
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=3)
    deployment_scale(deployment=deployment, desired_replicas=3)
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 3


@pytest.mark.parametrize("desired", [-1, 4])
def test_deployment_scale_out_of_bounds_raises_and_keeps_the_old_count(desired):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=3)
    with pytest.raises(ValidationError):
        deployment_scale(deployment=deployment, desired_replicas=desired)
    assert Deployment.objects.get(pk=deployment.pk).desired_replicas == 1
