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


@pytest.fixture
def unreadable_checkpoint(tmp_path_factory, tiny_checkpoint) -> Path:
    """A tiny llama checkpoint whose config and tokenizer are fine but whose weights file is not a
    safetensors file: a load that gets as far as the weights and fails there."""
    broken = tmp_path_factory.mktemp("broken") / "model"
    broken.mkdir()
    for item in tiny_checkpoint("llama").iterdir():
        (broken / item.name).symlink_to(item)
    [weights] = broken.glob("*.safetensors")
    weights.unlink()
    weights.write_bytes(b"not a safetensors file")
    return broken
