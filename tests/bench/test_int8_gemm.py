"""bench/int8_gemm.py --check-only on the CPU (interpreter, tiny shapes): the quantize-then-GEMM path and
the GEMM alone agree with the reference, and the JSON lists every shape and row count."""

from tests.bench.sweeps import run_check_only


def test_check_only_checks_every_path(tmp_path):
    result, stdout = run_check_only("int8_gemm", tmp_path)
    assert {(r["shape"], r["M"]) for r in result["results"]} == {
        ("ragged", 3),
        ("ragged", 20),
        ("deep", 3),
        ("deep", 20),
    }
    assert "FAILED" not in stdout
