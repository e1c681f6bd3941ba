"""A checkpoint named by its path or its Hugging Face id (`org/name`), as the online workers' last
reports describe it: what a new catalog model is filled with, so the operator types no parameter
count, context length or memory. Workers read their checkpoints themselves (the daemon's
checkpoint_reports, sent with each changed scan); nothing is downloaded.

    checkpoint_lookup(reference="meta-llama/Llama-3.2-1B", workers=online_workers)
    # -> CheckpointFacts(weights_path="/models/models--meta-llama--Llama-3.2-1B/snapshots/4e20...", ...)
"""

import posixpath
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from django.core.exceptions import ValidationError

from controlplane.catalog.models import Model
from controlplane.catalog.selectors import weights_path_reports
from controlplane.catalog.services import estimate_gpu_memory_bytes

# A Hugging Face repository id: "name" or "org/name".
HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
FIELD = "checkpoint"


@dataclass(frozen=True)
class CheckpointFacts:
    worker_name: str
    weights_path: str
    repo_id: str
    architecture: str
    family: str
    kind: str
    parameter_count: int
    context_length: int
    quantization: str
    gpu_memory_bytes: int

    def model_initial(self) -> dict:
        """The add-model form's fields filled from the checkpoint (the name: its id, or its folder)."""
        return {
            "public_name": self.repo_id or posixpath.basename(self.weights_path),
            "family": self.family,
            "kind": self.kind,
            "weights_path": self.weights_path,
            "context_length": self.context_length,
            "parameter_count": self.parameter_count,
            "quantization": self.quantization,
            "gpu_memory_bytes": self.gpu_memory_bytes,
        }

    def as_dict(self) -> dict:
        return asdict(self)


def _refuse(message: str) -> ValidationError:
    return ValidationError({FIELD: message})


def checkpoint_lookup(*, reference: str, workers: Iterable) -> CheckpointFacts:
    """What the first of `workers` (online fleet Workers) that has the checkpoint says about it;
    ValidationError on the "checkpoint" field saying why not: nothing named, no worker online, not
    found under their model roots, or found but not servable (an unsupported architecture)."""
    reference = reference.strip()
    workers = list(workers)
    if not reference:
        raise _refuse("Name a checkpoint: a path such as /models/llama-3-8b or a Hugging Face id such as org/name.")
    if not workers:
        raise _refuse(
            "No worker is online to read the checkpoint: start a worker daemon with --model-root naming "
            "the folder that holds it, then try again."
        )
    if reference.startswith("/"):
        found = _by_path(posixpath.normpath(reference), workers)
    elif HF_ID.match(reference):
        found = _by_repo_id(reference, workers)
    else:
        raise _refuse(f"{reference!r} is neither an absolute path nor a Hugging Face id such as org/name.")
    worker, path, report = found
    if report.get("problem"):
        raise _refuse(f"{worker.name} cannot serve the checkpoint at {path}: {report['problem']}.")
    if not report.get("parameter_count") or not report.get("context_length"):
        raise _refuse(f"{worker.name} read no parameter count or context length at {path}; enter them by hand.")
    quantization = (worker.model_quantization or {}).get(path, Model.Quantization.NONE)
    parameters = report["parameter_count"]
    return CheckpointFacts(
        worker_name=worker.name,
        weights_path=path,
        repo_id=report.get("repo_id", ""),
        architecture=report["architecture"],
        family=report["family"],
        kind=report["kind"],
        parameter_count=parameters,
        context_length=report["context_length"],
        quantization=quantization,
        gpu_memory_bytes=estimate_gpu_memory_bytes(parameter_count=parameters, quantization=quantization),
    )


def _first_servable(candidates: list[tuple]) -> tuple:
    return next((c for c in candidates if not c[2].get("problem")), candidates[0])


def _by_path(path: str, workers: list) -> tuple:
    candidates = [
        (worker, path, (worker.model_checkpoints or {})[path])
        for worker in workers
        if path in (worker.model_checkpoints or {})
    ]
    if candidates:
        return _first_servable(candidates)
    reports = weights_path_reports(weights_path=path, workers=workers)
    if any(r.loadable for r in reports):
        raise _refuse(
            f"The worker that has {path} did not say what it holds (an older daemon): enter its figures by hand."
        )
    raise _refuse(" ".join(r.message for r in reports))


def _by_repo_id(repo_id: str, workers: list) -> tuple:
    candidates = [
        (worker, path, report)
        for worker in workers
        for path, report in sorted((worker.model_checkpoints or {}).items())
        if report.get("repo_id") == repo_id
    ]
    if candidates:
        return _first_servable(candidates)
    cache_folder = "models--" + repo_id.replace("/", "--")
    roots = sorted({root for worker in workers for root in worker.model_roots})
    where = ", ".join(roots) if roots else "none: the online workers have no --model-root"
    raise _refuse(
        f"No online worker has {repo_id} under its model roots ({where}): it is looked for as "
        f"{repo_id}/ and, in a Hugging Face cache, {cache_folder}/snapshots/<revision>/. Download it "
        f"under a root (nothing is downloaded here), then try again once the worker reports it."
    )
