"""bench/latency.py and bench/throughput.py end to end on the CPU (--smoke: float32, the model of
--config at a tiny size), with the options their GPU runs use, so that a bug in a script's tables or
JSON shows here rather than minutes into a GPU run. bench/short_ttft.py runs in test_short_ttft.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import SMOKE_DIMS, load_hf_config, write_smoke_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "bench" / "configs"
LATENCY_KEYS = {
    "env",
    "args",
    "weight_gb_per_token",
    "copy_bandwidth_gbs",
    "gpuworker",
    "gpuworker_by_sampling",
    "gpuworker_weight_bandwidth_gbs",
    "hf",
}
THROUGHPUT_KEYS = {
    "env",
    "args",
    "gpuworker",
    "gpuworker_by_sampling",
    "gpuworker_subset",
    "hf_subset",
    "warmup_s",
    "max_num_seqs",
    "max_num_batched_tokens",
    "graph_capture_s",
    "kv_cache_tokens",
}


def _run(tmp_path: Path, script: str, *args: str) -> tuple[dict, str]:
    out = subprocess.run(
        [sys.executable, f"bench/{script}.py", "--smoke", *args],
        cwd=REPO,
        env={
            **os.environ,
            "OUT": str(tmp_path),
            "TMPDIR": str(tmp_path),
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((tmp_path / f"{script}.json").read_text()), out.stdout


def test_latency_times_each_sampling_mode_and_hf_with_an_fp8_kv_cache(tmp_path):
    modes = ["greedy", "t0.8-k200", "t0.7-p0.9", "t0.8-p0.95-seeded"]
    result, stdout = _run(tmp_path, "latency", "--sampling", ",".join(modes), "--kv-cache-dtype", "fp8")
    assert set(result) == LATENCY_KEYS
    assert list(result["gpuworker_by_sampling"]) == modes
    assert all(rate["decode_tok_s"] > 0 and rate["ttft_s"] > 0 for rate in result["gpuworker_by_sampling"].values())
    assert result["hf"]["decode_tok_s"] > 0
    assert result["copy_bandwidth_gbs"] is None and "n/a (cpu)" in stdout  # a GPU figure
    assert result["args"]["device"] == "cpu" and result["args"]["kv_cache_dtype"] == "fp8"
    assert "HF transformers decode" in stdout


def test_throughput_runs_each_sampling_mode_and_the_hf_baseline_with_an_fp8_kv_cache(tmp_path):
    result, stdout = _run(
        tmp_path,
        "throughput",
        "--sampling",
        "greedy,t0.8-k200",
        "--kv-cache-dtype",
        "fp8",
        "--hf-requests",
        "2",
        "--hf-batch-size",
        "2",
    )
    assert set(result) == THROUGHPUT_KEYS
    assert list(result["gpuworker_by_sampling"]) == ["greedy", "t0.8-k200"]
    assert result["gpuworker"]["output_tok_s"] > 0 and result["gpuworker"]["preemptions"] == 0
    assert result["gpuworker_subset"]["requests"] == result["hf_subset"]["requests"] == 2
    assert result["hf_subset"]["output_tok_s"] > 0 and result["kv_cache_tokens"] > 0
    assert "ratio (same requests)" in stdout and "where the wall time went" in stdout


@pytest.mark.parametrize(
    "config", ["llama-3-8b-awq", "llama-3-8b-fp8", "llama-3-8b-int8", "qwen3-30b-a3b", "llama-3-70b-fp8"]
)
@pytest.mark.parametrize("script", ["latency", "throughput"])
def test_the_gpu_runs_configs_run_at_a_tiny_size(tmp_path, script, config):
    result, _ = _run(tmp_path, script, "--config", str(CONFIGS / config), "--skip-hf")
    assert set(result) == (LATENCY_KEYS if script == "latency" else THROUGHPUT_KEYS)
    assert result["gpuworker"]["decode_tok_s" if script == "latency" else "output_tok_s"] > 0


def test_the_smoke_config_keeps_the_architecture_and_quantization_at_a_tiny_size(tmp_path):
    awq = load_hf_config(write_smoke_config(CONFIGS / "llama-3-8b-awq", tmp_path / "awq"))
    assert awq["quantization_config"] == load_hf_config(CONFIGS / "llama-3-8b-awq")["quantization_config"]
    assert awq["hidden_size"] == awq["intermediate_size"] == 128  # whole INT4 groups of 128
    assert awq["num_hidden_layers"] == 2 and awq["vocab_size"] == SMOKE_DIMS["vocab_size"]
    moe = load_hf_config(write_smoke_config(CONFIGS / "qwen3-30b-a3b", tmp_path / "moe"))
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"] and moe["model_type"] == "qwen3_moe"
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["head_dim"], moe["hidden_size"]) == (4, 2, 16, 64)


@pytest.mark.parametrize("config", ["llama-3-8b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("script", ["latency", "throughput"])
def test_the_multi_gpu_runs_options_run_at_two_cpu_ranks(tmp_path, script, config):
    # Issue 25's commands (BENCHMARKS.md) with --tensor-parallel-size 2: two gloo ranks on the CPU.
    result, stdout = _run(
        tmp_path, script, "--config", str(CONFIGS / config), "--skip-hf", "--tensor-parallel-size", "2"
    )
    assert result["args"]["tensor_parallel_size"] == "2" and "tensor parallel 2" in stdout
    assert result["gpuworker"]["decode_tok_s" if script == "latency" else "output_tok_s"] > 0


def test_the_moe_runs_take_the_all_to_all_expert_exchange_at_two_cpu_ranks(tmp_path):
    result, stdout = _run(
        tmp_path,
        "throughput",
        "--config",
        str(CONFIGS / "qwen3-30b-a3b"),
        "--skip-hf",
        "--tensor-parallel-size",
        "2",
        "--expert-parallel",
        "all_to_all",
    )
    assert result["args"]["expert_parallel"] == "all_to_all" and "tensor parallel 2 (all_to_all)" in stdout
    assert result["gpuworker"]["output_tok_s"] > 0
