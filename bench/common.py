"""Shared helpers for the benchmark scripts: command-line options, hardware facts, the HF baseline,
tables and JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = BENCH_DIR / "configs" / "llama-3-8b"


def engine_parser(doc: str | None, *, dtype: str | None = "bfloat16", dtype_help: str | None = None,
                  raw_description: bool = False) -> argparse.ArgumentParser:
    """A parser with the options of every engine benchmark: --config (the model's shape) and --dtype."""
    formatter = argparse.RawDescriptionHelpFormatter if raw_description else argparse.HelpFormatter
    parser = argparse.ArgumentParser(description=doc, formatter_class=formatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--dtype", default=dtype, help=dtype_help)
    return parser


def add_engine_options(parser: argparse.ArgumentParser, *, max_num_seqs: int, max_model_len: int) -> None:
    """The seed of the workload and the engine, and the engine's --max-num-seqs and --max-model-len,
    with the benchmark's defaults."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    parser.add_argument("--max-model-len", type=int, default=max_model_len)


# Sampling settings the engine benchmarks compare (--sampling): greedy against the filters the issue
# measured. "seeded" modes give request i the seed i.
SAMPLING_MODES = {
    "greedy": dict(temperature=0.0),
    "t0.8-k200": dict(temperature=0.8, top_k=200),
    "t0.7-p0.9": dict(temperature=0.7, top_p=0.9),
    "t0.8-p0.95": dict(temperature=0.8, top_p=0.95),
    "t0.8-p0.95-seeded": dict(temperature=0.8, top_p=0.95, seeded=True),
}


def add_sampling_option(parser: argparse.ArgumentParser, default: str = "greedy") -> None:
    parser.add_argument("--sampling", default=default,
                        help=f"comma-separated modes, each run in turn on the same engine: {', '.join(SAMPLING_MODES)}")


def sampling_modes(arg: str) -> list[str]:
    modes = [m for m in arg.split(",") if m]
    unknown = [m for m in modes if m not in SAMPLING_MODES]
    if unknown or not modes:
        raise SystemExit(f"--sampling: unknown mode(s) {unknown}; choose from {', '.join(SAMPLING_MODES)}")
    return modes


def sampling_params(mode: str, request_index: int, **fixed):
    """SamplingParams of `mode` for the request_index-th request, plus `fixed` (max_tokens...)."""
    from gpuworker.engine import SamplingParams

    settings = dict(SAMPLING_MODES[mode])
    if settings.pop("seeded", False):
        settings["seed"] = request_index
    return SamplingParams(**settings, **fixed)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True
        )
        return out.stdout.strip() or os.environ.get("GIT_COMMIT", "unknown")
    except OSError:
        return os.environ.get("GIT_COMMIT", "unknown")


def environment() -> dict:
    env = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": os.environ.get("GIT_COMMIT") or git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["gpu"] = "none (cpu)"
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth_gbs(num_bytes: int = 4 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / times[len(times) // 2] / 1e9


def load_hf_config(config_dir: Path) -> dict:
    return json.loads((Path(config_dir) / "config.json").read_text())


def weight_bytes_per_token(cfg: dict, bytes_per_param: int = 2) -> int:
    """Bytes of weights one decode step must read: every matrix, but only one embedding row."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // nh
    per_layer = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * i + 2 * h
    params = cfg["num_hidden_layers"] * per_layer + h + v * h  # + final norm + lm_head
    return params * bytes_per_param


def build_hf_model(config_dir: Path, dtype: torch.dtype):
    """A transformers model of the benchmark's shape with random weights, built on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@dataclass
class Timer:
    start: float = 0.0
    elapsed: float = 0.0

    def __enter__(self):
        synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize()
        self.elapsed = time.perf_counter() - self.start


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n== {title} ==")
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")


def write_json(name: str, payload: dict) -> Path:
    out_dir = Path(os.environ.get("OUT") or BENCH_DIR / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path
