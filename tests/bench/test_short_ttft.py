"""bench/short_ttft.py end to end on the CPU with a tiny model: short requests submitted while long
prompts prefill wait one step with the short-prompt share and many in plain arrival order."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


def test_the_cpu_run_reports_both_orders(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "bench/short_ttft.py",
            "--config",
            str(tmp_path / "model"),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--max-num-batched-tokens",
            "128",
            "--num-long",
            "3",
            "--long-len",
            "600",
            "--long-output",
            "2",
            "--shorts",
            "2",
            "--short-len",
            "16",
            "--short-output",
            "2",
        ],
        cwd=REPO,
        env={**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "short requests behind long prefills" in done.stdout
    plain, shared = json.loads((out / "short_ttft.json").read_text())["results"]
    assert (plain["share"], shared["share"]) == (0.0, 0.125)
    # 1,800 prompt tokens at 128 a step: in plain order the short ones wait for most of them.
    assert min(plain["short_waited_steps"]) >= 10
    assert shared["short_waited_steps"] == [1, 1]
    assert shared["short_ttft_max_s"] > 0 and shared["steps"] == plain["steps"]
