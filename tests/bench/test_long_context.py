"""bench/long_context.py end to end on the CPU (--smoke: the Llama-3.1 shape at a tiny size, a
context past its 512 positions): the prefill with short requests beside it, the HF baseline and the
profile; and --fill-cache, which must say that no prefill was measured."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--context", "1500", "--decode-tokens", "6", "--shorts", "3", "--short-len", "16", "--short-output", "2"]


def _run(tmp_path: Path, *args: str, name: str) -> tuple[dict, str]:
    out = subprocess.run(
        [sys.executable, "bench/long_context.py", "--smoke", *SMALL, "--max-num-batched-tokens", "256", *args],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((tmp_path / f"{name}.json").read_text()), out.stdout


def test_prefill_beside_short_requests_with_the_hf_baseline_and_profile(tmp_path):
    payload, stdout = _run(tmp_path, "--hf", "--profile", name="long_context-1500-auto")
    result = payload["gpuworker"]
    assert result["fill_cache"] is False and result["filled_tokens"] == 0
    assert result["prefill_s"] > 0 and result["prefill_tok_s"] > 0
    # Every short request joined and finished while the long one prefilled in 6 chunks.
    assert result["short_requests_served"] == 3
    assert result["decode_tok_s"] > 0 and result["decode_steps_timed"] >= 1
    assert result["max_model_len"] == 1506 and result["kv_pool_tokens"] >= 1506
    assert payload["hf"]["prefill_s"] > 0 and payload["hf"]["decode_tok_s"] > 0
    assert "aten::" in result["prefill_profile"]["table"]
    assert result["prefill_profile"]["attention_kernel_s"] is None  # device time: CUDA only
    assert "chunks of 256 tokens" in stdout


def test_fill_cache_decodes_at_full_context_and_says_prefill_was_not_measured(tmp_path):
    payload, stdout = _run(tmp_path, "--fill-cache", "--kv-cache-dtype", "fp8", name="long_context-1500-fp8-filled")
    result = payload["gpuworker"]
    assert result["fill_cache"] is True and result["kv_cache_dtype"] == "fp8"
    assert result["filled_tokens"] == 1488  # every full block of the prompt but its last token's
    assert result["prefill_s"] is None and result["prefill_tok_s"] is None
    assert result["decode_tok_s"] > 0
    assert "not measured: --fill-cache wrote random KV for 1488 tokens" in stdout
    assert payload["hf"] == {"skipped": "not asked (--hf)"}
