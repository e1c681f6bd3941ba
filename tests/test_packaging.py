"""The wheel pyproject.toml builds carries the data files the code reads at run time: the kernels' tuned
configs (gpuworker/kernels/configs/<kernel>/<device>.json), not only the Python modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_ships_the_tuned_kernel_configs(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # gpuworker alone: the configuration under test is its package data (controlplane has none).
    shutil.copytree(ROOT / "gpuworker", source / "gpuworker", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    # The locked setuptools, in this interpreter: no build isolation, nothing fetched.
    script = f"from setuptools import build_meta; build_meta.build_wheel({str(dist)!r})"
    build = subprocess.run([sys.executable, "-c", script], cwd=source, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = dist.glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(path.relative_to(ROOT)) for path in (ROOT / "gpuworker/kernels/configs").glob("*/*.json")}
    assert expected, "no config files in the source tree"
    assert expected <= shipped, f"missing from the wheel: {sorted(expected - shipped)}"
