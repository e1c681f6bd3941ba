"""bench/quant_gemm.py --check-only on the CPU (interpreter, tiny shapes): the dequantise-then-mm path and
every Triton tile the GPU sweep would time agree with the reference, and the JSON lists them."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_check_only_checks_every_path(tmp_path):
    out = subprocess.run([sys.executable, "bench/quant_gemm.py", "--check-only"], cwd=REPO,
                         env={**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "quant_gemm_check.json").read_text())
    assert {(r["shape"], r["M"]) for r in result["results"]} == {
        ("ragged", 3), ("ragged", 20), ("deep", 3), ("deep", 20)}
    assert "FAILED" not in out.stdout
