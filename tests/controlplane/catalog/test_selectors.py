import pytest

from controlplane.catalog.selectors import model_get_by_public_name, models_by_public_name
from tests.controlplane.factories import ModelFactory

pytestmark = pytest.mark.django_db


def test_model_get_by_public_name():
    model = ModelFactory(public_name="qwen2-7b")
    assert model_get_by_public_name(public_name="qwen2-7b") == model
    assert model_get_by_public_name(public_name="qwen2") is None


def test_models_by_public_name_returns_only_known_names():
    a, b = ModelFactory(), ModelFactory()
    found = models_by_public_name(public_names=[a.public_name, b.public_name, "missing"])
    assert found == {a.public_name: a, b.public_name: b}
