"""Which checkpoints this host has: the directories under the daemon's model roots (--model-root)
that hold a Hugging Face config.json or a GGUF file. The daemon reports them, with what it read in each
(checkpoint_reports), so the control plane's catalog can check a model's weight path and fill in its figures
before any replica is placed, and loads nothing from outside them.

    scan_model_roots([Path("/models")])  # -> ModelPaths(roots=("/models",), paths=("/models/llama-8b", ...))
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from gpuworker.checkpoint_files import GGUF_SUFFIX
from gpuworker.checkpoint_quantization import parse_quantization
from gpuworker.contract.heartbeat import MAX_MODEL_PATHS, ModelPaths
from gpuworker.daemon.checkpoint_reports import checkpoint_report

logger = logging.getLogger(__name__)

# Where the daemon's --model-root default comes from (folders separated by ':').
MODEL_ROOTS_ENV = "GPUSERVE_MODEL_ROOTS"

# Deep enough for /models/<org>/<name>/<revision>; bounded so a root pointed at / stays cheap.
MAX_DEPTH = 3


def _checkpoints_under(root: Path, depth: int, found: list[str]) -> None:
    if len(found) >= MAX_MODEL_PATHS:
        return
    try:
        if (root / "config.json").is_file() or any(
            entry.name.endswith(GGUF_SUFFIX) and entry.is_file() for entry in os.scandir(root)
        ):
            found.append(str(root))
            return  # a checkpoint's own subfolders (e.g. original/) are not separate models
        if depth >= MAX_DEPTH:
            return
        children = sorted(
            entry.path
            for entry in os.scandir(root)
            if entry.is_dir(follow_symlinks=True) and not entry.name.startswith(".")
        )
    except OSError as exc:  # unreadable folders are skipped, not fatal: the rest still counts
        logger.debug("cannot scan %s: %s", root, exc)
        return
    for child in children:
        _checkpoints_under(Path(child), depth + 1, found)


def scan_model_roots(roots: list[Path] | tuple[Path, ...]) -> ModelPaths:
    """Absolute, normalised roots and the checkpoint directories found under them, sorted."""
    absolute = tuple(dict.fromkeys(os.path.normpath(os.path.abspath(root)) for root in roots))
    found: list[str] = []
    for root in absolute:
        if not os.path.isdir(root):
            logger.warning("model root %s is not a directory; nothing found there", root)
            continue
        _checkpoints_under(Path(root), 0, found)
    if len(found) >= MAX_MODEL_PATHS:
        logger.warning(
            "more than %d checkpoints under %s; reporting the first %d",
            MAX_MODEL_PATHS,
            ", ".join(absolute),
            MAX_MODEL_PATHS,
        )
    paths = tuple(sorted(dict.fromkeys(found[:MAX_MODEL_PATHS])))
    quantization = tuple((path, label) for path in paths if (label := checkpoint_quantization(Path(path))))
    checkpoints = tuple(
        (path, checkpoint_report(Path(path), root=Path(next(r for r in absolute if _inside(path, r)))))
        for path in paths
    )
    return ModelPaths(roots=absolute, paths=paths, quantization=quantization, checkpoints=checkpoints)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def checkpoint_quantization(directory: Path) -> str | None:
    """The quantization label of the checkpoint in `directory` (from its config.json), None for a
    float or GGUF checkpoint, or one whose quantization is unreadable or not served (its load says why)."""
    try:
        config = json.loads((directory / "config.json").read_text())
        quant = parse_quantization(config, str(directory / "config.json")) if isinstance(config, dict) else None
    except (OSError, ValueError) as exc:
        logger.debug("no quantization read from %s: %s", directory, exc)
        return None
    return None if quant is None else quant.label


def resolve_model_root_path(model_path: str, roots: tuple[Path, ...]) -> tuple[Path | None, str | None]:
    """`model_path` resolved (realpath: `..` and symlinks followed) if it lies inside one of
    `roots` (themselves resolved), else why not. A daemon with no roots loads nothing: a load
    task names a path chosen elsewhere, and the roots are what confines it to the checkpoints."""
    if not roots:
        return None, (
            f"this worker has no model root, so it loads no model: start its daemon with "
            f"--model-root DIR (or ${MODEL_ROOTS_ENV}) naming the folder that holds {model_path}"
        )
    resolved = Path(os.path.realpath(model_path))
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    if any(resolved == root or root in resolved.parents for root in real_roots):
        return resolved, None
    shown = model_path if str(resolved) == model_path else f"{model_path} (resolved: {resolved})"
    return None, (
        f"model path {shown} lies outside this worker's model roots "
        f"({', '.join(str(r) for r in real_roots)}); move the checkpoint under one or start the "
        f"daemon with another --model-root"
    )
