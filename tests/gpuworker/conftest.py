"""Fixtures for the gpuworker tests: tiny random checkpoints, built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """tiny_checkpoint(family, **config_overrides) -> the directory of a tiny random checkpoint
    (see tests/gpuworker/checkpoints.py), built on first use and shared by the whole session."""
    from tests.gpuworker.checkpoints import make_checkpoint

    built: dict[tuple, Path] = {}

    def build(family: str = "llama", **overrides: Any) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_checkpoint(tmp_path_factory.mktemp("checkpoint"), family, **overrides)
        return built[key]

    return build
