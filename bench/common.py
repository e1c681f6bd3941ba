"""Shared helpers for the benchmark scripts: command-line options, hardware facts, the HF baseline,
random full-size checkpoints, replica processes, tables and JSON. Torch is imported where it is used,
so a load generator's processes start without it."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
DEFAULT_CONFIG = BENCH_DIR / "configs" / "llama-3-8b"
# A full-size replica on a cold page cache takes minutes to load.
READY_DEADLINE_S = 900.0


def engine_parser(
    doc: str | None,
    *,
    dtype: str | None = "bfloat16",
    dtype_help: str | None = None,
    device: str | None = "cuda",
    raw_description: bool = False,
) -> argparse.ArgumentParser:
    """A parser with the options of every engine benchmark: --config (the model's shape), --dtype and,
    unless `device` is None (a CUDA-only benchmark), --device."""
    formatter = argparse.RawDescriptionHelpFormatter if raw_description else argparse.HelpFormatter
    parser = argparse.ArgumentParser(description=doc, formatter_class=formatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--dtype", default=dtype, help=dtype_help)
    if device is not None:
        parser.add_argument("--device", default=device)
    return parser


# --smoke: the model of --config at this size (quantized projections keep whole groups).
SMOKE_DIMS = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SMOKE_EXPERTS = {
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
}
SMOKE_LATENT = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


def dummy_engine(args: argparse.Namespace, **options):
    """An LLMEngine on random weights of args.config (engine_parser's options: device, dtype, seed);
    `options` are the bench's own engine settings."""
    from gpuworker.engine import LLMEngine

    return LLMEngine(
        str(args.config), device=args.device, dtype=args.dtype, load_format="dummy", seed=args.seed, **options
    )


def add_smoke_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the CPU, float32, --config's architecture and quantization at a tiny size, a few "
        "requests: the whole script in seconds (tests)",
    )


def use_smoke_model(args: argparse.Namespace) -> None:
    """--smoke's device, dtype and model: args.config becomes a tiny config written to a new
    temporary directory."""
    args.device, args.dtype = "cpu", "float32"
    args.config = write_smoke_config(args.config, Path(tempfile.mkdtemp(prefix="bench-smoke-")))


def write_smoke_config(config_dir: Path, directory: Path) -> Path:
    """config_dir's config.json (architecture, quantization_config, experts) with SMOKE_DIMS, into
    `directory`; returns `directory`."""
    cfg = {**load_hf_config(config_dir), **SMOKE_DIMS}
    cfg |= {key: value for key, value in SMOKE_EXPERTS.items() if key in cfg}
    if cfg.get("kv_lora_rank"):  # latent attention: one key-value head per query head
        cfg |= SMOKE_LATENT | {"num_key_value_heads": cfg["num_attention_heads"]}
    group = (cfg.get("quantization_config") or {}).get("group_size")
    if group:  # INT4: every projection's input whole groups
        cfg["hidden_size"] = max(cfg["hidden_size"], group)
        cfg["intermediate_size"] = max(cfg["intermediate_size"], group)
    if "head_dim" in cfg:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def add_engine_options(parser: argparse.ArgumentParser, *, max_num_seqs: int | None, max_model_len: int) -> None:
    """The seed of the workload and the engine, and the engine's --max-num-seqs and --max-model-len,
    with the benchmark's defaults (max_num_seqs None: the engine's choice for the device)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    parser.add_argument("--max-model-len", type=int, default=max_model_len)


def add_parallel_option(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size: the engine's ranks, one GPU each (NCCL, NVLink multicast off), or one
    process each on the CPU (gloo; --smoke); --expert-parallel: how a MoE model's ranks join their
    experts (the engine's EngineConfig.expert_parallel)."""
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--expert-parallel", choices=("all_reduce", "all_to_all"), default="all_reduce")


def add_kv_cache_dtype_option(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype: the engine's KV cache in the model's dtype ("auto") or FP8 e4m3 ("fp8": twice
    the blocks in the same memory)."""
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")


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
    parser.add_argument(
        "--sampling",
        default=default,
        help=f"comma-separated modes, each run in turn on the same engine: {', '.join(SAMPLING_MODES)}",
    )


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
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True)
        return out.stdout.strip() or os.environ.get("GIT_COMMIT", "unknown")
    except OSError:
        return os.environ.get("GIT_COMMIT", "unknown")


def environment() -> dict:
    import torch

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


@dataclass(frozen=True)
class KernelSweep:
    """Where a kernel sweep runs: `device`, whether it times (`timed`), the environment, and the
    device's copy bandwidth when it was measured."""

    device: str
    timed: bool
    env: dict
    copy_gbps: float | None


def start_kernel_sweep(script: str, check_only: bool, *, copy_bandwidth: bool = True) -> KernelSweep:
    """The start every kernel sweep shares (bench/gemv.py, quant_gemv.py, moe_decode.py, sampling.py):
    on a GPU it times unless --check-only; without one only --check-only runs, under the Triton
    interpreter (set here, so it must come before the kernels are launched). A timed run prints the
    environment, and with `copy_bandwidth` measures and prints the copy bandwidth."""
    import torch

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        if not check_only:
            raise SystemExit(f"bench/{script} needs a CUDA device (or --check-only, which runs the Triton interpreter)")
        os.environ["TRITON_INTERPRET"] = "1"  # read at launch by gpuworker.kernels.launch
    timed = on_cuda and not check_only
    env = environment()
    copy_gbps = copy_bandwidth_gbs(num_bytes=2 << 30) if timed and copy_bandwidth else None
    if timed:
        print(
            f"{env.get('gpu')}  torch {env.get('torch')}  triton {env.get('triton')}"
            + (f"  copy bandwidth {copy_gbps:.0f} GB/s (read + write)" if copy_gbps else "")
        )
    return KernelSweep("cuda" if on_cuda else "cpu", timed, env, copy_gbps)


def add_write_configs_option(parser: argparse.ArgumentParser, what: str) -> None:
    """--write-configs: a kernel sweep merges its winners into the tuned configs of the GPU it ran on."""
    parser.add_argument(
        "--write-configs", action="store_true", help=f"merge the winners into {what} for this GPU (a timed run)"
    )


def pick_tile(results: list[dict], time_key: str) -> str | None:
    """Of a kernel sweep's rows ({"config", "ok", time_key}), the tile with the lowest geometric
    mean of `time_key` over every row; a tile with a row not checked ok or not timed never wins."""
    by_tile: dict[str, list[float]] = {}
    for row in results:
        by_tile.setdefault(row["config"], []).append(row[time_key] if row["ok"] and time_key in row else math.inf)
    scores = {tile: math.exp(sum(map(math.log, times)) / len(times)) for tile, times in by_tile.items()}
    finite = {tile: score for tile, score in scores.items() if math.isfinite(score)}
    return min(finite, key=finite.get) if finite else None


def write_configs(kernel: str, key: tuple[str, ...], records: list[dict], remove: list[dict] | tuple = ()) -> Path:
    """Merge a sweep's records into gpuworker/kernels/configs/<kernel>/<this GPU>.json (and take the
    records of `remove` out) through the loader's writer; print where."""
    import torch

    from gpuworker.kernels import configs

    path = configs.write(kernel, key, records, device=configs.device_name(torch.device("cuda")), remove=remove)
    print(f"wrote {len(records)} config(s) to {path}" + (f", removed {len(remove)}" if remove else ""))
    return path


def synchronize(device: str) -> None:
    """Wait for the work queued on `device` (the CPU has none)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: str) -> None:
    """Give the memory the caching allocator of `device` holds back (the CPU's is the process's)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth_gbs(num_bytes: int = 4 << 30, repeats: int = 20) -> float:
    """GPU device-to-device copy bandwidth, counting bytes read plus bytes written."""
    import torch

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


def attention_heads(cfg: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a Hugging Face config."""
    heads = cfg["num_attention_heads"]
    return heads, cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads


def attention_params(cfg: dict) -> int:
    """Parameters of one layer's attention projections: q, k, v and o; with latent attention
    (DeepSeek's kv_lora_rank) the query (through its low-rank pair when q_lora_rank is set), the
    latent and rotary-key projection, the latent's up-projection to keys and values, and o."""
    h = cfg["hidden_size"]
    nh, nkv, hd = attention_heads(cfg)
    if cfg.get("kv_lora_rank"):
        latent, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        qk, v = cfg["qk_nope_head_dim"] + rope, cfg["v_head_dim"]
        q_rank = cfg.get("q_lora_rank")
        q = h * nh * qk if not q_rank else h * q_rank + q_rank + q_rank * nh * qk
        return q + h * (latent + rope) + latent + latent * nh * (qk - rope + v) + nh * v * h
    return h * nh * hd + 2 * h * nkv * hd + nh * hd * h


def mlp_params_per_token(cfg: dict) -> tuple[int, int]:
    """(dense layer MLP, sparse layer MLP) parameters one token multiplies through: of a mixture of
    experts the router, the top-k experts and the shared experts."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if not experts:
        return 3 * h * i, 3 * h * i
    expert_i = cfg.get("moe_intermediate_size") or i
    sparse = experts * h + 3 * h * expert_i * cfg["num_experts_per_tok"]
    if cfg.get("shared_expert_intermediate_size"):  # Qwen-MoE: one gated shared expert
        sparse += 3 * h * cfg["shared_expert_intermediate_size"] + h
    sparse += 3 * h * expert_i * (cfg.get("n_shared_experts") or 0)  # DeepSeek, GLM
    return 3 * h * i, sparse


def weight_bytes_per_token(cfg: dict, bytes_per_param: int = 2) -> int:
    """Bytes of weights one decode step must read: every matrix, but only one embedding row; of a
    mixture of experts, the router and the top-k experts' MLPs (a batch of one token)."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    dense_mlp, sparse_mlp = mlp_params_per_token(cfg)
    dense_layers = min(layers, cfg.get("first_k_dense_replace") or 0)  # DeepSeek, GLM: the first k dense
    mlp = dense_layers * dense_mlp + (layers - dense_layers) * sparse_mlp
    per_layer = attention_params(cfg) + 2 * h
    params = layers * per_layer + mlp + h + v * h  # + final norm + lm_head
    quantization = cfg.get("quantization_config")
    if quantization is None:
        return params * bytes_per_param
    # Quantized checkpoints: the decoder's projections at FP8's byte, or INT4's half byte plus a
    # float16 scale and a uint8 zero point per 128 weights; norms and lm_head stay dense.
    projections = layers * (per_layer - 2 * h) + mlp
    quantized_bytes = 0.5 + 3 / 128 if quantization.get("quant_method") in ("awq", "gptq") else 1
    return int((params - projections) * bytes_per_param + projections * quantized_bytes)


@dataclass(frozen=True)
class GpuPeak:
    """A GPU's dense bf16 tensor-core rate and memory bandwidth, from its vendor's data sheet."""

    tflops: float
    tbps: float


def gpu_peaks() -> dict[str, GpuPeak]:
    """The data sheets' rates by GPU name (bench/configs/gpu_peaks.json); a GPU not there gets no
    least time rather than a guess."""
    gpus = json.loads((BENCH_DIR / "configs" / "gpu_peaks.json").read_text())["gpus"]
    return {name: GpuPeak(g["dense_bf16_tflops"], g["memory_tbps"]) for name, g in gpus.items()}


def projection_params(cfg: dict) -> tuple[int, int]:
    """(every decoder layer's projections, lm_head): the weights one token multiplies through, at
    2 FLOPs each (norms, biases and the embedding lookup are left out)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    return layers * (attention_params(cfg) + 3 * h * cfg["intermediate_size"]), h * cfg["vocab_size"]


def attention_flops(cfg: dict, pairs: int) -> int:
    """FLOPs of QK^T and PV over `pairs` (query, key) pairs in every layer."""
    heads, _, head_dim = attention_heads(cfg)
    return cfg["num_hidden_layers"] * 4 * heads * head_dim * pairs


def kv_bytes_per_token(cfg: dict, bytes_per_value: int = 2) -> int:
    """Bytes of one position's keys and values over all layers."""
    _, kv_heads, head_dim = attention_heads(cfg)
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * bytes_per_value


def roofline_s(flops: float, num_bytes: float, tflops: float, tbps: float) -> float:
    """The least time of work that must do `flops` and move `num_bytes`, each at its peak, overlapped."""
    return max(flops / (tflops * 1e12), num_bytes / (tbps * 1e12))


def build_hf_model(config_dir: Path, dtype: torch.dtype, device: str):
    """A transformers model of the benchmark's shape with random weights, built on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def hf_tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads, head_dim = attention_heads(cfg)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def write_checkpoint(directory: Path, config_dir: Path, shards: int) -> None:
    """Random bf16 weights in HF layout; skipped when the directory is complete already."""
    import torch
    from safetensors.torch import save_file

    from gpuworker.demo_model import MIN_VOCAB_SIZE, write_tokenizer

    if (directory / "complete").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((config_dir / "config.json").read_text())
    shapes = hf_tensor_shapes(cfg)
    total = sum(2 * _numel(shape) for _, shape in shapes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    groups, current, size = [], [], 0
    for name, shape in shapes:  # contiguous groups of about total/shards bytes, in HF order
        current.append((name, shape))
        size += 2 * _numel(shape)
        if size >= total / shards and len(groups) < shards - 1:
            groups.append(current)
            current, size = [], 0
    groups.append(current)
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            name: (torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * 0.02).cpu()
            for name, shape in group
        }
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in tensors}
        del tensors
        with open(directory / file, "rb") as f:
            os.fsync(f.fileno())  # written to disk, so DONTNEED can drop the pages later
        print(f"wrote {file}", flush=True)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    shutil.copy(config_dir / "config.json", directory / "config.json")
    write_tokenizer(directory, MIN_VOCAB_SIZE, cfg["max_position_embeddings"])  # its tokenizer_config.json
    write_llama3_like_tokenizer(directory, cfg["vocab_size"])
    (directory / "complete").write_text("")


def write_llama3_like_tokenizer(directory: Path, vocab_size: int, num_special: int = 256) -> None:
    """A byte-level BPE tokenizer.json shaped like Llama 3's: vocab_size - 256 merged tokens
    (made-up merges) and 256 special tokens, so loading it costs what the real one costs."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from gpuworker.demo_model import SPECIAL_TOKENS

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    tokens, merges, a = list(chars), [], 0
    while len(vocab) < vocab_size - num_special:
        for c in chars:
            if len(vocab) >= vocab_size - num_special:
                break
            if tokens[a] + c not in vocab:
                vocab[tokens[a] + c] = len(vocab)
                merges.append((tokens[a], c))
                tokens.append(tokens[a] + c)
        a += 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [*SPECIAL_TOKENS, *(f"<|reserved_special_token_{i}|>" for i in range(num_special - len(SPECIAL_TOKENS)))]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(directory / "tokenizer.json"))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_path(*first: Path | str) -> str:
    """PYTHONPATH for a child process: `first`, then this process's own entries, so that a machine's
    extra package folders (the GPU machine's carried wheels, installed under /tmp/site) stay on it."""
    entries = [str(p) for p in first] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def start_replica(
    model: Path, *, device: str, dtype: str, log: Path, tree: Path = ROOT, extra_args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """`python -m gpuworker serve` from the checkout `tree`, spawned as the daemon spawns it, on a
    free port: the process and its base URL. Its output goes to `log`."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "gpuworker",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
        "--log-level",
        "warning",
        *extra_args,
    ]
    env = {**os.environ, "PYTHONPATH": python_path(tree), "PYTHONUNBUFFERED": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            argv, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, f"http://127.0.0.1:{port}"


def wait_ready(
    process: subprocess.Popen, url: str, log: Path, deadline_s: float = READY_DEADLINE_S, token: str | None = None
) -> dict:
    """Poll the replica's /health until it is ready: its last /health answer. Raises when the
    process exits, the load fails or the deadline passes. `token`: the replica's --token."""
    import httpx

    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=2.0, headers=headers) as client:
        while time.perf_counter() - started < deadline_s:
            if process.poll() is not None:
                raise RuntimeError(f"the replica exited with {process.returncode}; see {log}")
            try:
                health = client.get(f"{url}/health").json()
            except (httpx.HTTPError, ValueError):
                health = {}
            if health.get("status") == "ready":
                return health
            if health.get("status") == "failed":
                raise RuntimeError(f"the replica failed: {health.get('error')}")
            time.sleep(0.02)
    raise RuntimeError(f"no ready replica within {deadline_s:.0f}s; see {log}")


def stop_replica(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class Timer:
    """Wall time of a block, the work queued on `device` within it included."""

    device: str
    start: float = 0.0
    elapsed: float = 0.0

    def __enter__(self):
        synchronize(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        self.elapsed = time.perf_counter() - self.start


class Profiled:
    """torch.profiler over a window (CPU ops, and the kernels on a CUDA device) and its wall time,
    the work queued on the device within it included; `with Profiled(device) as p:` or start/stop."""

    def __init__(self, device: str) -> None:
        self.on_device = device.startswith("cuda")
        self.device = device
        self.profiler = None
        self.wall_s = 0.0
        self._started = 0.0

    def start(self) -> Profiled:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_device else [])
        synchronize(self.device)
        self.profiler = profile(activities=activities)
        self.profiler.start()
        self._started = time.perf_counter()
        return self

    def stop(self) -> None:
        synchronize(self.device)
        self.wall_s = time.perf_counter() - self._started
        self.profiler.stop()

    __enter__ = start

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def top_kernels(self, count: int | None, host: bool = False) -> list[tuple[str, float, int]]:
        """(name, seconds, calls) of the kernels with the most device time, largest first (None: all);
        on the CPU or with `host`, of the ops with the most host self time. Profiler ranges (user
        annotations) are no kernels."""
        key = "self_cpu_time_total" if host or not self.on_device else "self_device_time_total"
        timed = [
            (e.key, getattr(e, key) / 1e6, e.count)
            for e in self.profiler.key_averages()
            if getattr(e, key) > 0 and not getattr(e, "is_user_annotation", False)
        ]
        return sorted(timed, key=lambda row: -row[1])[:count]

    def phases(self, ranges: dict[str, str]) -> dict:
        """Where the window's wall time went by phase: `ranges` maps a record_function name to its
        phase, and the innermost range around a piece of work names its phase. Per phase the
        device time of the kernels launched inside it (on the CPU: the host time inside it, less
        the nested ranges'), its share of the wall, and its host time; "outside the ranges" holds
        the kernels launched elsewhere, "host gaps" the wall time the device ran nothing (on the
        CPU: the time outside every range)."""
        from torch.autograd import DeviceType

        events = [e for e in self.profiler.events() if e.device_type == DeviceType.CPU]
        host = _range_seconds(events, ranges)
        seconds = _kernel_seconds(events, ranges) if self.on_device else dict(host)
        busy = _busy_seconds(self.profiler.events()) if self.on_device else sum(seconds.values())
        names = [*dict.fromkeys(ranges.values())] + ([OUTSIDE_RANGES] if self.on_device else [])
        table = {
            name: {
                "s": round(seconds.get(name, 0.0), 4),
                "share": round(seconds.get(name, 0.0) / self.wall_s, 4),
                "host_s": round(host.get(name, 0.0), 4),
            }
            for name in names
        }
        gaps = max(0.0, self.wall_s - busy)
        table[HOST_GAPS] = {"s": round(gaps, 4), "share": round(gaps / self.wall_s, 4), "host_s": None}
        return {"wall_s": round(self.wall_s, 4), "device_busy_s": round(busy, 4), "phases": table}


OUTSIDE_RANGES = "outside the ranges"
HOST_GAPS = "host gaps"


def _phase_of(event, ranges: dict[str, str]) -> str:
    """The phase of the innermost range around `event` (itself included)."""
    while event is not None:
        if event.name in ranges:
            return ranges[event.name]
        event = event.cpu_parent
    return OUTSIDE_RANGES


def _kernel_seconds(events: list, ranges: dict[str, str]) -> dict[str, float]:
    """Per phase, the device time of the kernels the host events launched."""
    seconds: dict[str, float] = {}
    for event in events:
        if event.kernels:
            phase = _phase_of(event, ranges)
            seconds[phase] = seconds.get(phase, 0.0) + sum(k.duration for k in event.kernels) / 1e6
    return seconds


def _range_seconds(events: list, ranges: dict[str, str]) -> dict[str, float]:
    """Per phase, the host time inside its ranges less the ranges nested in them."""
    seconds: dict[str, float] = {}
    for event in events:
        if event.name not in ranges:
            continue
        phase, elapsed = ranges[event.name], event.cpu_time_total / 1e6
        seconds[phase] = seconds.get(phase, 0.0) + elapsed
        outer = _phase_of(event.cpu_parent, ranges)
        if outer != OUTSIDE_RANGES:
            seconds[outer] = seconds.get(outer, 0.0) - elapsed
    return seconds


def _busy_seconds(events) -> float:
    """The union of the device's kernel and copy intervals (profiler ranges on the device left out)."""
    from torch.autograd import DeviceType

    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    )
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e6


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
