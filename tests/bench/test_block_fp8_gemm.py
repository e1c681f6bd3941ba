"""bench/block_fp8_gemm.py --check-only on the CPU (interpreter, tiny shapes): every Triton tile the GPU
sweep would time agrees with the reference, and the JSON lists the shapes and row counts."""

from tests.bench.sweeps import run_check_only


def test_check_only_checks_every_tile(tmp_path):
    result, stdout = run_check_only("block_fp8_gemm", tmp_path)
    assert {(r["shape"], r["M"]) for r in result["results"]} == {
        ("ragged", 3),
        ("ragged", 20),
        ("whole", 3),
        ("whole", 20),
    }
    assert "FAILED" not in stdout
