"""bench/quant_gemv.py --check-only on the CPU (interpreter, tiny shapes): every INT4 and FP8 candidate
the GPU sweep would time, split-K included, agrees with its reference, and the JSON says so."""

from tests.bench.sweeps import run_check_only


def test_check_only_checks_every_candidate(tmp_path):
    result, stdout = run_check_only("quant_gemv", tmp_path)
    assert [(r["kernel"], r["shape"]) for r in result["results"]] == [
        ("int4", "ragged"),
        ("int4", "deep"),
        ("fp8", "ragged"),
        ("fp8", "deep"),
    ]
    assert all(r["all_ok"] for r in result["results"])
    names = {e["config"] for e in result["sweep"]}
    assert any(name.startswith("int4-") and not name.endswith("-s1") for name in names)  # INT4 split-K
    assert any(name.endswith("k") and "-s" in name for name in names)  # FP8 split-K (gemv's "-s4k")
    assert "max abs err" in stdout
