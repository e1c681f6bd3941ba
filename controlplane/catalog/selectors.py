"""Reads for the catalog."""

from collections.abc import Iterable

from controlplane.catalog.models import Deployment, Model


def model_get_by_public_name(*, public_name: str) -> Model | None:
    return Model.objects.select_related("price_tier").filter(public_name=public_name).first()


def models_by_public_name(*, public_names: Iterable[str]) -> dict[str, Model]:
    return {m.public_name: m for m in Model.objects.filter(public_name__in=list(public_names))}



def deployment_get_for_model(*, model: Model) -> Deployment | None:
    return Deployment.objects.filter(model=model).first()
