"""bench/common.py: the bytes a decode step reads, for the configs the benchmarks run."""

from __future__ import annotations

import sys

import pytest

from tests.bench.conftest import BENCH


@pytest.fixture(scope="module")
def common(bench_script):
    return bench_script("common")


def test_quantized_configs_read_fewer_bytes(common):
    bf16, fp8, int8, awq = (
        common.weight_bytes_per_token(common.load_hf_config(BENCH / "configs" / name))
        for name in ("llama-3-8b", "llama-3-8b-fp8", "llama-3-8b-int8", "llama-3-8b-awq")
    )
    assert round(bf16 / 1e9, 2) == 15.01  # Llama-3-8B without its embedding table, at 2 bytes
    # The projections (6.98 B parameters) at 1 byte and at 0.52 bytes; lm_head and norms at 2.
    assert round(fp8 / 1e9, 2) == round(int8 / 1e9, 2) == 8.03
    assert round(awq / 1e9, 2) == 4.70


def test_a_bench_server_keeps_the_machines_extra_package_folders(tmp_path, monkeypatch):
    """The GPU machine installs the carried wheels under a folder of its own on PYTHONPATH: the
    replica, gateway and worker a bench starts must import from it too (the shedding bench's
    servers failed on `import pydantic` when their PYTHONPATH was the checkout alone)."""
    from bench.embedded import ROOT, _start

    extra = tmp_path / "site"
    monkeypatch.setenv("PYTHONPATH", str(extra))
    log = tmp_path / "child.log"
    child = _start([sys.executable, "-c", "import sys; print(sys.path)"], log)
    assert child.wait(timeout=60) == 0
    printed = log.read_text()
    assert str(extra) in printed and str(ROOT) in printed
