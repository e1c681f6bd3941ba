"""Reads for the catalog: models by public name, the lists the pages offer, and what the workers
report about a model's weight path (a worker loads only from inside its model roots, so a path
elsewhere cannot load)."""

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from django.db.models import QuerySet

from controlplane.catalog.models import Deployment, Model
from gpuworker.contract.openai_api import ImageRules


def model_get_by_public_name(*, public_name: str) -> Model | None:
    return Model.objects.select_related("price_tier").filter(public_name=public_name).first()


def image_rules(*, public_name: str, kind: str, max_images_per_request: int, max_image_bytes: int) -> ImageRules:
    """What a model takes in a request's images: a vision model, up to its limits; others none."""
    return ImageRules(
        model_name=public_name,
        takes_images=kind == Model.Kind.VISION,
        max_images=max_images_per_request,
        max_image_bytes=max_image_bytes,
    )


def model_image_rules(*, public_name: str) -> ImageRules | None:
    """The image rules of the model of that name; None when the catalog has none."""
    found = (
        Model.objects.filter(public_name=public_name)
        .values("public_name", "kind", "max_images_per_request", "max_image_bytes")
        .first()
    )
    return image_rules(**found) if found else None


def models_by_public_name(*, public_names: Iterable[str]) -> dict[str, Model]:
    return {m.public_name: m for m in Model.objects.filter(public_name__in=list(public_names))}


def catalog_models() -> QuerySet[Model]:
    """Every model in the catalog, enabled or not, with its price tier, by public name."""
    return Model.objects.select_related("price_tier").order_by("public_name")


def model_names_enabled() -> list[str]:
    """The public names of the models clients may call now, in order."""
    return list(Model.objects.filter(enabled=True).order_by("public_name").values_list("public_name", flat=True))


def text_models_for_key(*, api_key) -> QuerySet[Model]:
    """The enabled text models (the playground's) an accounts ApiKey may call, by public name."""
    models = models_for_playground()
    if not api_key.all_models:
        models = models.filter(pk__in=[m.pk for m in api_key.allowed_models.all()])
    return models


def models_for_playground() -> QuerySet[Model]:
    """The models a tenant may try in the playground: every enabled model that generates text
    (playground keys may call every model, as the tenant's own keys may by default)."""
    return Model.objects.filter(enabled=True).exclude(kind=Model.Kind.EMBEDDING).order_by("public_name")


def deployments_with_model() -> QuerySet[Deployment]:
    """Every deployment with its model (the operators' forms name a deployment by its model)."""
    return Deployment.objects.select_related("model")


@dataclass(frozen=True)
class WeightsPathReport:
    worker_name: str
    # found; missing (under one of the worker's model roots, but no checkpoint there); outside (outside
    # every root: the worker refuses to load it); no_roots (the worker has no model root: it loads
    # nothing). Only "found" lets the worker load the model.
    status: str
    message: str

    @property
    def loadable(self) -> bool:
        return self.status == "found"


def reported_quantization(*, weights_path: str, workers: Iterable) -> str | None:
    """How the checkpoint at `weights_path` is quantized, as the first of `workers` that has it
    reports (Model.Quantization.NONE for a float checkpoint); None when none of them has it."""
    path = posixpath.normpath(weights_path.strip()) if weights_path.strip() else ""
    for worker in workers:
        if path in {posixpath.normpath(p) for p in worker.model_paths}:
            reported = {posixpath.normpath(p): label for p, label in (worker.model_quantization or {}).items()}
            return reported.get(path, Model.Quantization.NONE)
    return None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def weights_path_reports(*, weights_path: str, workers: Iterable) -> list[WeightsPathReport]:
    """What each worker's last report says about a checkpoint directory: whether it lies inside
    the worker's model roots (the path normalised, so `..` cannot leave them; symlinks the worker
    resolves itself before loading) and whether a checkpoint is there.
    `workers`: fleet Workers (their name, model_roots and model_paths are all that is read)."""
    path = posixpath.normpath(weights_path.strip()) if weights_path.strip() else ""
    reports = []
    for worker in workers:
        roots = [posixpath.normpath(root) for root in worker.model_roots]
        found = {posixpath.normpath(p) for p in worker.model_paths}
        if not roots:
            reports.append(
                WeightsPathReport(
                    worker.name,
                    "no_roots",
                    f"{worker.name} reports no model roots, so it loads no model: start "
                    f"its daemon with --model-root DIR naming the folder that holds {path}.",
                )
            )
        elif not any(_under(path, root) for root in roots):
            reports.append(
                WeightsPathReport(
                    worker.name,
                    "outside",
                    f"{path} lies outside {worker.name}'s model roots ({', '.join(roots)}), "
                    f"so it refuses to load it: put the checkpoint under one of them, "
                    f"or start its daemon with another --model-root.",
                )
            )
        elif path in found or (path.endswith(".gguf") and posixpath.dirname(path) in found):
            # A GGUF file is its own checkpoint; the daemon reports the folder that holds it.
            reports.append(WeightsPathReport(worker.name, "found", f"{worker.name} has a checkpoint at {path}."))
        else:
            reports.append(
                WeightsPathReport(
                    worker.name,
                    "missing",
                    f"{worker.name} has no checkpoint (a directory with config.json "
                    f"or a .gguf file) at {path}; it found {len(found)} under {', '.join(roots)}.",
                )
            )
    return reports


def perplexity_increase(*, model: Model) -> float | None:
    """How much higher the model's perplexity is than its base model's, as a fraction (0.02: 2%
    higher; negative: lower), or None when either is unmeasured or they were measured on different
    text, windows or token counts (figures compare only at equal terms)."""
    base = model.base_model
    if base is None or model.perplexity is None or base.perplexity is None:
        return None
    terms = ("perplexity_text_sha256", "perplexity_window", "perplexity_tokens")
    if any(getattr(model, term) != getattr(base, term) for term in terms):
        return None
    return model.perplexity / base.perplexity - 1


def quality_refusal(*, deployment: Deployment) -> str:
    """Why the deployment may not place replicas under its quality bar (max_perplexity_increase),
    or "" when it may (no bar set, or the model within it)."""
    bound = deployment.max_perplexity_increase
    if bound is None:
        return ""
    model = deployment.model
    name = model.public_name
    if model.perplexity is None:
        return (
            f"{name} must have its perplexity measured before it serves (this deployment requires at most "
            f"{bound:.2%} above its base model): run `python -m gpuworker.quality` on a worker and record the report"
        )
    if model.base_model is None:
        return f"{name} has no base model to compare its perplexity with: set its base model in the catalog"
    increase = perplexity_increase(model=model)
    if increase is None:
        return (
            f"{name}'s perplexity and its base model {model.base_model.public_name}'s were not measured on the same "
            "text, window and tokens: measure both with the same command"
        )
    if increase > bound:
        return (
            f"{name}'s perplexity is {increase:.2%} above its base model's; this deployment allows at most {bound:.2%}"
        )
    return ""
