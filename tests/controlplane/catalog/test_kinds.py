"""The catalog offers only kinds of model that the gateway can serve."""

from controlplane.catalog.models import Model
from controlplane.gateway.completions import ENDPOINTS


def test_every_catalog_kind_has_a_serving_endpoint():
    served = {
        "embedding" if for_embeddings else kind
        for _, for_embeddings in ENDPOINTS.values()
        for kind in ("chat", "completion", "vision")  # a vision model chats, with images
    }
    assert set(Model.Kind.values) <= served, set(Model.Kind.values) - served
