"""bench/moe_decode.py --check-only on the CPU (tiny shapes, interpreter): every config it would time
on the GPU runs and agrees with the reference, and the JSON has a row per token count, so that a
bug in the script shows here rather than on the H200."""

from tests.bench.sweeps import run_check_only


def test_the_check_only_mode_checks_every_config_of_the_sweep(tmp_path):
    result, _ = run_check_only("moe_decode", tmp_path, "--quick")
    assert not result["timed"]
    assert [(r["M"], r["top_k"]) for r in result["results"]] == [(1, 8), (4, 8), (1, 2), (4, 2)]
    assert all(r["all_ok"] and r["routing_ids_equal"] for r in result["results"])
    configs = {e["config"] for e in result["sweep"]}
    assert "grouped" in configs and len(configs) == 4  # the grouped kernels and three decode configs
    assert all(e["ok"] and e["max_abs_err"] < 1e-4 for e in result["sweep"])  # float32 on the CPU
