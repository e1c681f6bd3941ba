"""bench/quant_gemv.py --check-only on the CPU (interpreter, tiny shapes): every INT4 and FP8 candidate
the GPU sweep would time, split-K included, agrees with its reference, and the JSON says so."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_check_only_checks_every_candidate(tmp_path):
    out = subprocess.run([sys.executable, "bench/quant_gemv.py", "--check-only"], cwd=REPO,
                         env={**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "quant_gemv_check.json").read_text())
    assert [(r["kernel"], r["shape"]) for r in result["results"]] == [
        ("int4", "ragged"), ("int4", "deep"), ("fp8", "ragged"), ("fp8", "deep")]
    assert all(r["all_ok"] for r in result["results"])
    names = {e["config"] for e in result["sweep"]}
    assert any(name.startswith("int4-") and not name.endswith("-s1") for name in names)  # INT4 split-K
    assert any(name.endswith("k") and "-s" in name for name in names)  # FP8 split-K (gemv's "-s4k")
    assert "max abs err" in out.stdout
