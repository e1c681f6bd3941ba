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


def test_a_profiled_window_gives_each_piece_of_work_to_its_innermost_range(common):
    import torch
    from torch.profiler import record_function

    x = torch.randn(64, 64)
    with common.Profiled("cpu") as profiled:
        with record_function("outer"):
            x @ x
            with record_function("inner"):
                x @ x
        x @ x  # outside every range: the CPU's "host gaps"
    events = {e.name: e.cpu_time_total / 1e6 for e in profiled.profiler.events() if e.name in ("outer", "inner")}
    result = profiled.phases({"outer": "a", "inner": "b"})
    phases = result["phases"]
    assert list(phases) == ["a", "b", common.HOST_GAPS]
    assert phases["b"]["s"] == pytest.approx(events["inner"], abs=1e-4)
    assert phases["a"]["s"] == pytest.approx(events["outer"] - events["inner"], abs=1e-4)
    assert phases["a"]["s"] == phases["a"]["host_s"]
    assert phases["a"]["share"] == pytest.approx((events["outer"] - events["inner"]) / profiled.wall_s, abs=1e-3)
    gaps = phases[common.HOST_GAPS]["s"]
    assert gaps > 0 and gaps == pytest.approx(result["wall_s"] - events["outer"], abs=1e-3)
    names = [name for name, _, _ in profiled.top_kernels(None)]
    assert "aten::mm" in names and "outer" not in names and "inner" not in names  # ranges are no kernels
