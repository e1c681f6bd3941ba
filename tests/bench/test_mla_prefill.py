"""bench/mla_prefill.py: --check-only on the CPU runs the per-sequence loop and every tile of the quick
sweep against the reference (tiny shapes, interpreter), and --write-configs' record is what the kernel
then picks."""

from __future__ import annotations

import torch

from gpuworker.kernels import configs
from tests.bench.sweeps import run_check_only


def test_the_check_only_mode_checks_the_loop_and_every_tile(tmp_path):
    result, _ = run_check_only("mla_prefill", tmp_path, "--quick")
    assert not result["timed"] and result["best_config"] is None
    assert {(c["workload"], c["heads"]) for c in result["comparisons"]} == {
        ("prompts", 2),
        ("prompts", 5),
        ("chunks", 2),
        ("chunks", 5),
    }
    assert all(c["ok"] and "loop_us" not in c for c in result["comparisons"])
    assert len({r["config"] for r in result["results"]}) >= 8
    assert all(r["ok"] and r["max_abs_err"] < 1e-4 for r in result["results"])


def test_the_recorded_tile_is_what_the_kernel_picks_on_that_gpu(bench_script, tmp_path, monkeypatch):
    from gpuworker.kernels.attention.mla_prefill import DEFAULT_CONFIG, FLOAT32_CONFIG, KERNEL, TABLE_KEY, tuned_config

    mla_prefill = bench_script("mla_prefill")
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(configs, "device_name", lambda device=None: "Test GPU")
    tiles = mla_prefill.candidates(quick=True)
    best = mla_prefill.name(tiles[-1])
    configs.write(KERNEL, TABLE_KEY, mla_prefill.config_records(best, tiles), device="Test GPU")
    cpu = torch.device("cpu")
    assert tuned_config(torch.bfloat16, 128, 64, 128, cpu) == tiles[-1] != DEFAULT_CONFIG
    # Another shape or dtype keeps its defaults.
    assert tuned_config(torch.bfloat16, 64, 64, 128, cpu) == DEFAULT_CONFIG
    assert tuned_config(torch.float32, 128, 64, 128, cpu) == FLOAT32_CONFIG
