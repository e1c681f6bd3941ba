"""What the daemon reads from each checkpoint it finds under its model roots, for the catalog:
the Hugging Face id it answers to, its architecture, what it serves as, its parameter count (from
the safetensors headers, no weights read) and context length, or why the engine cannot serve it.

    checkpoint_report(Path("/models/meta-llama/Llama-3.2-1B"), root=Path("/models"))
    # -> CheckpointReport(repo_id="meta-llama/Llama-3.2-1B", architecture="LlamaForCausalLM", ...)

Reports are kept per directory until its config.json or its file list changes, so the scan every
few seconds reads headers only for checkpoints that are new or changed.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuworker.architectures import served_architecture, supported_names
from gpuworker.checkpoint_files import checkpoint_files, gguf_file, read_header, read_json
from gpuworker.contract.heartbeat import MAX_CHECKPOINT_PROBLEM_CHARS, MAX_MODEL_PATHS, CheckpointReport

logger = logging.getLogger(__name__)

# The Hugging Face hub cache's layout: <cache>/models--<org>--<name>/snapshots/<revision>, with
# refs/main naming the revision the hub's main branch pointed at when it was downloaded.
HF_CACHE_PREFIX = "models--"
HF_CACHE_SEPARATOR = "--"
# Quantizers' side tensors: scales, zero points and group indices are no parameters of the model.
_SIDE_TENSOR_SUFFIXES = ("_scale", "_scale_inv", ".scales", ".qzeros", ".g_idx", ".weight_zero_point")
# INT4 checkpoints pack eight 4-bit weights into each int32 of a qweight.
_PACKED_INT4_PER_ELEMENT = 8


def repo_id_for(directory: Path, root: Path) -> str:
    """The Hugging Face id `directory` answers to under `root`: "org/name" for root/org/name or for
    the current snapshot of root/models--org--name (refs/main's, or the only one), "name" for
    root/name; "" for any other place."""
    try:
        parts = directory.relative_to(root).parts
    except ValueError:
        return ""
    if len(parts) == 3 and parts[0].startswith(HF_CACHE_PREFIX) and parts[1] == "snapshots":
        repo = root / parts[0]
        if _current_snapshot(repo) != parts[2]:
            return ""
        return "/".join(parts[0][len(HF_CACHE_PREFIX) :].split(HF_CACHE_SEPARATOR))
    if len(parts) in (1, 2) and not parts[0].startswith(HF_CACHE_PREFIX):
        return "/".join(parts)
    return ""


def _current_snapshot(repo: Path) -> str | None:
    try:
        return (repo / "refs" / "main").read_text().strip()
    except OSError:
        snapshots = [entry.name for entry in os.scandir(repo / "snapshots") if entry.is_dir()]
        return snapshots[0] if len(snapshots) == 1 else None


def checkpoint_report(directory: Path, *, root: Path) -> CheckpointReport:
    """What `directory` (a checkpoint found under `root`) holds, read again only when it changed."""
    try:
        config_stamp = (directory / "config.json").stat().st_mtime_ns
    except OSError:
        config_stamp = None
    try:
        directory_stamp = directory.stat().st_mtime_ns
    except OSError:
        directory_stamp = None
    # The id is looked up each time: refs/main can move without the snapshot changing.
    return replace(_report(str(directory), config_stamp, directory_stamp), repo_id=repo_id_for(directory, root))


@functools.lru_cache(maxsize=MAX_MODEL_PATHS)
def _report(directory: str, config_stamp: int | None, directory_stamp: int | None) -> CheckpointReport:
    try:
        return _read(Path(directory))
    except (OSError, ValueError) as exc:
        logger.debug("cannot read the checkpoint at %s: %s", directory, exc)
        return CheckpointReport(problem=_problem(str(exc)))


def _problem(text: str) -> str:
    return text[:MAX_CHECKPOINT_PROBLEM_CHARS]


def _read(directory: Path) -> CheckpointReport:
    if gguf_file(directory) is not None:
        return CheckpointReport(
            problem="a GGUF checkpoint: its architecture and size are not read from here; enter them by hand",
        )
    config = read_json(directory / "config.json", required=True)
    served = served_architecture(config)
    family = str(config.get("model_type") or "")[:50]
    if served is None:
        named = config.get("architectures") or config.get("model_type")
        return CheckpointReport(
            family=family,
            problem=_problem(f"unsupported architecture {named!r}; this engine serves {supported_names()}"),
        )
    architecture, kind = served
    return CheckpointReport(
        architecture=architecture,
        family=family,
        kind=kind,
        parameter_count=parameter_count(directory),
        context_length=context_length(config),
    )


def context_length(config: dict[str, Any]) -> int | None:
    """config.json's max_position_embeddings, or its text decoder's (vision models)."""
    for source in (config, config.get("text_config") or {}):
        value = source.get("max_position_embeddings") if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def parameter_count(directory: Path) -> int:
    """The model's parameters, from its safetensors headers: every tensor's elements, quantizers'
    scales and zero points left out and packed INT4 weights counted as the weights they hold."""
    total = 0
    for file in checkpoint_files(directory):
        for entry in read_header(file):
            if entry.name.endswith(_SIDE_TENSOR_SUFFIXES):
                continue
            count = 1
            for size in entry.shape:
                count *= size
            if entry.name.endswith(".qweight") and entry.dtype == "I32":
                count *= _PACKED_INT4_PER_ELEMENT
            total += count
    if total == 0:
        raise ValueError(f"{directory}: its safetensors files hold no tensors")
    return total
