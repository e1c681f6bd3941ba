"""Which checkpoints this host has: the directories under the daemon's model roots (--model-root)
that hold a Hugging Face config.json. The daemon reports them so the control plane's catalog can
check a model's weight path before any replica is placed.

    scan_model_roots([Path("/models")])  # -> ModelScan(roots=("/models",), paths=("/models/llama-8b", ...))
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Deep enough for /models/<org>/<name>/<revision>; bounded so a root pointed at / stays cheap.
MAX_DEPTH = 3
# The control plane accepts at most this many paths per worker (controlplane.fleet.reports).
MAX_PATHS = 2000


@dataclass(frozen=True)
class ModelScan:
    roots: tuple[str, ...]
    paths: tuple[str, ...]

    def to_payload(self) -> dict[str, list[str]]:
        return {"roots": list(self.roots), "paths": list(self.paths)}


def _checkpoints_under(root: Path, depth: int, found: list[str]) -> None:
    if len(found) >= MAX_PATHS:
        return
    try:
        if (root / "config.json").is_file():
            found.append(str(root))
            return  # a checkpoint's own subfolders (e.g. original/) are not separate models
        if depth >= MAX_DEPTH:
            return
        children = sorted(entry.path for entry in os.scandir(root)
                          if entry.is_dir(follow_symlinks=True) and not entry.name.startswith("."))
    except OSError as exc:  # unreadable folders are skipped, not fatal: the rest still counts
        logger.debug("cannot scan %s: %s", root, exc)
        return
    for child in children:
        _checkpoints_under(Path(child), depth + 1, found)


def scan_model_roots(roots: list[Path] | tuple[Path, ...]) -> ModelScan:
    """Absolute, normalised roots and the checkpoint directories found under them, sorted."""
    absolute = tuple(dict.fromkeys(os.path.normpath(os.path.abspath(root)) for root in roots))
    found: list[str] = []
    for root in absolute:
        if not os.path.isdir(root):
            logger.warning("model root %s is not a directory; nothing found there", root)
            continue
        _checkpoints_under(Path(root), 0, found)
    if len(found) >= MAX_PATHS:
        logger.warning("more than %d checkpoints under %s; reporting the first %d", MAX_PATHS,
                       ", ".join(absolute), MAX_PATHS)
    return ModelScan(roots=absolute, paths=tuple(sorted(dict.fromkeys(found[:MAX_PATHS]))))
