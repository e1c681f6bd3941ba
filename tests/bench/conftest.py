"""Helpers for the tests of bench/'s scripts."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_script():
    """bench_script(name) -> the module bench/name.py, imported as the scripts import each other
    (bench/ on sys.path, `import common`) for the test module's life."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCH))
