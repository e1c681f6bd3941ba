"""Run a kernel sweep's --check-only mode (bench/quant_gemv.py, quant_gemm.py, moe_decode.py) on the CPU the
way the tests do: a subprocess at the repository root, its JSON written to out_dir."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_check_only(script: str, out_dir: Path, *args: str) -> tuple[dict, str]:
    """(the script's <name>_check.json, its stdout); fails the test with its output if it fails."""
    out = subprocess.run(
        [sys.executable, f"bench/{script}.py", "--check-only", *args],
        cwd=REPO,
        env={**os.environ, "OUT": str(out_dir), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((out_dir / f"{script}_check.json").read_text()), out.stdout
