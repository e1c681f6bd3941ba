"""bench/mla_decode.py: --check-only on the CPU runs every tile of the quick sweep against the
reference (tiny shapes, interpreter), and --write-configs' record is what the kernel then picks."""

from __future__ import annotations

import torch

from gpuworker.kernels import configs
from tests.bench.sweeps import run_check_only


def test_the_check_only_mode_checks_every_tile(tmp_path):
    result, _ = run_check_only("mla_decode", tmp_path, "--quick")
    assert not result["timed"] and result["best_config"] is None
    assert len({r["config"] for r in result["results"]}) >= 8
    assert all(r["ok"] and r["max_abs_err"] < 1e-4 for r in result["results"])


def test_the_recorded_tile_is_what_the_kernel_picks_on_that_gpu(bench_script, tmp_path, monkeypatch):
    from gpuworker.kernels.attention.mla_decode import DEFAULT_CONFIG, KERNEL, TABLE_KEY, tuned_config

    mla_decode = bench_script("mla_decode")
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(configs, "device_name", lambda device=None: "Test GPU")
    tiles = mla_decode.candidates(quick=True)
    best = mla_decode.name(tiles[-1])
    configs.write(KERNEL, TABLE_KEY, mla_decode.config_records(best, tiles), device="Test GPU")
    cpu = torch.device("cpu")
    assert tuned_config(torch.bfloat16, 512, 64, cpu) == tiles[-1]
    # Another shape or dtype keeps the defaults.
    assert tuned_config(torch.bfloat16, 256, 64, cpu) == DEFAULT_CONFIG
    assert tuned_config(torch.float32, 512, 64, cpu) == DEFAULT_CONFIG
