"""Reads for the catalog: models by public name, and what the workers report about a model's
weight path."""

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from controlplane.catalog.models import Model


def model_get_by_public_name(*, public_name: str) -> Model | None:
    return Model.objects.select_related("price_tier").filter(public_name=public_name).first()


def models_by_public_name(*, public_names: Iterable[str]) -> dict[str, Model]:
    return {m.public_name: m for m in Model.objects.filter(public_name__in=list(public_names))}


@dataclass(frozen=True)
class WeightsPathReport:
    worker_name: str
    # found; missing (under a root the worker searches, but no checkpoint there); unwatched (outside
    # every root it searches); unreported (the worker reports no model roots at all).
    status: str
    message: str


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def weights_path_reports(*, weights_path: str, workers: Iterable) -> list[WeightsPathReport]:
    """What each worker's last report says about a checkpoint directory. Only a worker that
    searches the directory's root can say it is missing; the others cannot tell either way.
    `workers`: fleet Workers (their name, model_roots and model_paths are all that is read)."""
    path = posixpath.normpath(weights_path.strip()) if weights_path.strip() else ""
    reports = []
    for worker in workers:
        roots = [posixpath.normpath(root) for root in worker.model_roots]
        found = {posixpath.normpath(p) for p in worker.model_paths}
        if not roots:
            reports.append(WeightsPathReport(worker.name, "unreported",
                                             f"{worker.name} reports no model roots (start its daemon with "
                                             f"--model-root DIR to have paths checked)."))
        elif path in found:
            reports.append(WeightsPathReport(worker.name, "found", f"{worker.name} has a checkpoint at {path}."))
        elif any(_under(path, root) for root in roots):
            reports.append(WeightsPathReport(worker.name, "missing",
                                             f"{worker.name} has no checkpoint (a directory with config.json) at "
                                             f"{path}; it found {len(found)} under {', '.join(roots)}."))
        else:
            reports.append(WeightsPathReport(worker.name, "unwatched",
                                             f"{worker.name} searches only {', '.join(roots)}, so it cannot "
                                             f"confirm {path}."))
    return reports
