"""Vision serving: Qwen2.5-VL through the engine against HF transformers in the same run (random
weights of --config's shape; images are random noise of --image-size pixels a side).

    python bench/vision.py [--config bench/configs/qwen2.5-vl-7b] [--requests 256] [--output 128]
    python bench/vision.py --smoke    # the CPU, a tiny Qwen2.5-VL, a few small images (tests)

Figures: preprocessing images per second on one CPU core (transformers' image processor, as the
serving side runs it in its process pool); the engine's TTFT for one image and a --question-tokens
question (median of --ttft-runs, each a new image: the encoder runs every time); the engine's
throughput for --requests requests each with its own image and --output tokens out (greedy,
ignore_eos), with the device's busy share over the run from torch.cuda's utilisation samples (None
off CUDA or without NVML); HF's TTFT and throughput on the same requests (the first --hf-requests)
in batches of --hf-batch (generate, greedy); the least time the throughput run's work allows on the
GPU (bench/vision_bound.py: FLOPs at its dense bf16 peak, decode steps' bytes at its bandwidth, at
the engine's batch), the engine's wall over it, and the throughput ratio to HF that least time would
give (--bound-gpu: whose peak figures, default the device's; one not in bench/configs/gpu_peaks.json is named
and skipped). Writes vision.json (--json): the figures, the arguments and the image's and prompt's
token counts.

--profile runs the throughput run under torch.profiler (which slows it) and prints where its wall
time went by phase: the vision encoder (tower and merger), the LLM's prefill steps, its decode steps
(the engine's record_function ranges, engine.model_runner), kernels launched outside them, and the
host gaps, the wall time the GPU ran nothing; per phase the GPU time of its kernels, its share of the
wall and the host time inside it (on the CPU the host time is the phase's time and the gaps are the
time outside the phases), then the top --profile-kernels kernels (ops on the CPU) by total time.
vision.json has it under "profile".
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common import (
    BENCH_DIR,
    HOST_GAPS,
    ROOT,
    Profiled,
    add_engine_options,
    add_smoke_option,
    dummy_engine,
    engine_parser,
    environment,
    free_device_memory,
    gpu_peaks,
    load_hf_config,
    print_table,
    synchronize,
    write_json,
)
from vision_bound import least_time

DEFAULT_VISION_CONFIG = BENCH_DIR / "configs" / "qwen2.5-vl-7b"
# --smoke's workload where an option is left at its default: a few small images, a few tokens out.
SMOKE = {
    "requests": 4,
    "output": 4,
    "question_tokens": 8,
    "image_size": 64,
    "ttft_runs": 2,
    "hf_batch": 2,
    "hf_requests": 2,
    "max_model_len": 256,
}


def use_smoke_vision_model(args, parser) -> None:
    """--smoke: the CPU in float32, the tests' tiny Qwen2.5-VL checkpoint (its image processor keeps
    images to a few patches) and SMOKE's workload for the options left at their defaults."""
    sys.path.insert(0, str(ROOT))
    from tests.gpuworker.models.vision_checkpoints import make_qwen2_5_vl

    args.device, args.dtype = "cpu", "float32"
    args.config = make_qwen2_5_vl(Path(tempfile.mkdtemp(prefix="bench-smoke-")))
    for name, value in SMOKE.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


def noise_images(count: int, size: int, seed: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def preprocess_rate(config_dir: str, images: list) -> float:
    """Images a second through preprocess_image with torch on one thread (one core's rate: the
    serving side's pool runs one image a process)."""
    import torch

    from gpuworker.engine.multimodal import preprocess_image

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        preprocess_image(config_dir, images[0])
        started = time.perf_counter()
        for image in images:
            preprocess_image(config_dir, image)
        return len(images) / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


def image_token_ids(config_dir) -> tuple[int, int, int]:
    """(vision start, image, vision end) token ids of the checkpoint's config.json."""
    cfg = load_hf_config(config_dir)
    return cfg["vision_start_token_id"], cfg["image_token_id"], cfg["vision_end_token_id"]


def prompt_ids(image, tokens: tuple[int, int, int], question: int, seed: int) -> list[int]:
    """The image between its vision start and end tokens, then `question` random text ids below
    every special id."""
    from gpuworker.engine.multimodal import expand_image_tokens

    rng = np.random.default_rng(seed)
    text = rng.integers(10, min(20000, min(tokens) - 8), question).tolist()
    return expand_image_tokens([*tokens, *text], [image], tokens[1])


class BusySampler:
    """The GPU's utilisation (NVML, through torch.cuda.utilization) sampled every 50 ms while the
    block runs; on another device, or without NVML, no samples (busy is None)."""

    def __init__(self, device: str) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._cuda = device.startswith("cuda")

    def _run(self) -> None:
        import torch

        while not self._stop.wait(0.05):
            try:
                self.samples.append(torch.cuda.utilization())
            except Exception:  # no NVML: no figure
                return

    def __enter__(self) -> BusySampler:
        if self._cuda:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def busy(self) -> float | None:
        return round(statistics.mean(self.samples) / 100, 3) if self.samples else None


def run_engine(args, requests: list) -> dict:
    """requests: (ImageInput, prompt ids) pairs; the first warms up, the next --ttft-runs time the
    first token, the rest (up to --requests) the throughput."""
    from gpuworker.engine import SamplingParams

    engine = dummy_engine(
        args,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts = []
    for image, ids in requests[: 1 + args.ttft_runs]:  # the first is the warm-up
        started = time.perf_counter()
        engine.generate([ids], one, images=[[image]])
        ttfts.append(time.perf_counter() - started)
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    work = requests[1 + args.ttft_runs :][: args.requests]
    profiled = Profiled(args.device) if args.profile else contextlib.nullcontext()
    with BusySampler(args.device) as sampler, profiled:
        started = time.perf_counter()
        outputs = engine.generate([ids for _, ids in work], params, images=[[image] for image, _ in work])
        elapsed = time.perf_counter() - started
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    engine.shutdown()
    row = _row(ttfts[1:], len(work), tokens, elapsed)
    row |= {"gpu_busy": sampler.busy, "max_num_seqs": engine.config.max_num_seqs}
    if args.profile:
        row["profile"] = profile_row(profiled, args.profile_kernels)
    return row


def profile_row(profiled: Profiled, kernels: int) -> dict:
    """The throughput run's phases (Profiled.phases over the engine's ranges) and its top kernels."""
    from gpuworker.engine.model_runner import DECODE_STEP_RANGE, PREFILL_STEP_RANGE, VISION_ENCODER_RANGE

    ranges = {
        VISION_ENCODER_RANGE: "vision encoder",
        PREFILL_STEP_RANGE: "prefill steps",
        DECODE_STEP_RANGE: "decode steps",
    }
    top = [
        {"name": name, "s": round(seconds, 4), "calls": calls} for name, seconds, calls in profiled.top_kernels(kernels)
    ]
    return profiled.phases(ranges) | {"device": "cuda" if profiled.on_device else "cpu", "top_kernels": top}


def print_profile(profile: dict) -> None:
    """The phases' seconds and shares of the wall, then the top kernels."""
    timed = "GPU" if profile["device"] == "cuda" else "host"
    rows = [("wall", f"{profile['wall_s']:.3f} s, {timed} busy {profile['device_busy_s']:.3f} s")]
    for name, phase in profile["phases"].items():
        host = "" if name == HOST_GAPS else f" (host {phase['host_s']:.3f} s)"
        rows.append((name, f"{phase['s']:.3f} s, {100 * phase['share']:.1f}% of wall{host}"))
    print_table(f"where the throughput run's {timed} time went (profiled)", rows)
    print_table(
        f"top {len(profile['top_kernels'])} {'kernels' if timed == 'GPU' else 'ops'} by total time",
        [(k["name"][:70], f"{k['s']:.4f} s x{k['calls']}") for k in profile["top_kernels"]],
    )


def _row(ttfts: list[float], requests: int, tokens: int, elapsed: float) -> dict:
    return {
        "ttft_ms": round(1000 * statistics.median(ttfts), 1),
        "requests": requests,
        "output_tokens": tokens,
        "throughput_tok_s": round(tokens / elapsed, 1),
        "requests_s": round(requests / elapsed, 2),
        "wall_s": round(elapsed, 2),
    }


def run_hf(args, requests: list, image_token_id: int) -> dict:
    """transformers' Qwen2_5_VLForConditionalGeneration on the engine's requests: TTFT one at a
    time, throughput in batches of --hf-batch over the first --hf-requests."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(args.config))
    with torch.device(args.device):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=getattr(torch, args.dtype))
    model.eval()

    def generate(batch: list, max_new: int) -> int:
        ids = torch.tensor([prompt for _, prompt in batch])
        out = model.generate(
            ids.to(args.device),
            attention_mask=torch.ones_like(ids).to(args.device),
            pixel_values=torch.cat([image.pixel_values for image, _ in batch]).to(args.device, model.dtype),
            image_grid_thw=torch.tensor([image.grid_thw for image, _ in batch], device=args.device),
            mm_token_type_ids=(ids == image_token_id).int().to(args.device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
        )
        synchronize(args.device)
        return (out.shape[1] - ids.shape[1]) * len(batch)

    with torch.inference_mode():
        ttfts = []
        for i in range(1 + args.ttft_runs):  # the first is the warm-up
            started = time.perf_counter()
            generate(requests[i : i + 1], 1)
            ttfts.append(time.perf_counter() - started)
        work = requests[1 + args.ttft_runs :][: args.hf_requests or args.requests]
        started, tokens = time.perf_counter(), 0
        for i in range(0, len(work), args.hf_batch):
            tokens += generate(work[i : i + args.hf_batch], args.output)
        elapsed = time.perf_counter() - started
    return _row(ttfts[1:], len(work), tokens, elapsed)


def least_time_row(args, image, prompt_tokens: int, rows: dict, gpu: str) -> dict:
    """The least time of the engine's throughput run on `gpu` (its requests, image grid, prompt and
    output lengths, decode batch: --requests capped by the engine's max_num_seqs), its wall over it,
    and the output tok/s and ratio to HF it would give; `gpu` not in bench/configs/gpu_peaks.json: why it is skipped."""
    peak = gpu_peaks().get(gpu)
    if peak is None:
        return {"gpu": gpu, "skipped": f"no dense bf16 peak or bandwidth for {gpu!r} in bench/configs/gpu_peaks.json"}
    engine = rows["engine"]
    workload = {
        "requests": engine["requests"],
        "grid_thw": tuple(image.grid_thw),
        "prompt_tokens": prompt_tokens,
        "output_tokens": args.output,
        "decode_batch": min(engine["requests"], engine["max_num_seqs"]),
    }
    bound = {"gpu": gpu} | least_time(load_hf_config(args.config), workload, peak)
    bound["engine_wall_over_least_time"] = round(engine["wall_s"] / bound["least_time_s"], 2)
    if "hf" in rows:
        bound["max_ratio_to_hf"] = round(bound["max_throughput_tok_s"] / rows["hf"]["throughput_tok_s"], 1)
    return bound


def print_least_time(bound: dict, wall_s: float) -> None:
    if "skipped" in bound:
        print(f"least time: skipped, {bound['skipped']}")
        return
    print_table(f"least time on {bound['gpu']}", [(key, str(value)) for key, value in bound.items() if key != "gpu"])
    ratio = f", {bound['max_ratio_to_hf']}x HF" if "max_ratio_to_hf" in bound else ""
    print(
        f"least time {bound['least_time_s']} s: the engine's {wall_s} s wall is "
        f"{bound['engine_wall_over_least_time']}x it; at the least time "
        f"{bound['max_throughput_tok_s']} output tok/s{ratio}"
    )


def main() -> None:
    parser = engine_parser(__doc__, raw_description=True)
    parser.set_defaults(config=DEFAULT_VISION_CONFIG)
    add_engine_options(parser, max_num_seqs=None, max_model_len=4096)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--ttft-runs", type=int, default=5)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument(
        "--hf-requests", type=int, default=None, help="HF's throughput over the first N requests (default: all)"
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="the throughput run under torch.profiler: time by phase, top kernels"
    )
    parser.add_argument("--profile-kernels", type=int, default=15, help="how many kernels --profile lists")
    parser.add_argument("--bound-gpu", default=None, help="the GPU whose peaks give the least time (default: this one)")
    add_smoke_option(parser)
    parser.add_argument("--json", default="vision", help="result file name under bench/results (or $OUT)")
    args = parser.parse_args()
    if args.smoke:
        use_smoke_vision_model(args, parser)

    from gpuworker.engine.multimodal import preprocess_image

    tokens = image_token_ids(args.config)
    images = noise_images(1 + args.ttft_runs + args.requests, args.image_size, args.seed)
    rate = preprocess_rate(str(args.config), images[: min(8, len(images))])
    inputs = [preprocess_image(args.config, image) for image in images]
    requests = [(image, prompt_ids(image, tokens, args.question_tokens, i)) for i, image in enumerate(inputs)]
    rows = {"engine": run_engine(args, requests)}
    gc.collect()  # the engine's KV cache and weights, before HF's model needs the memory
    free_device_memory(args.device)
    if not args.skip_hf:
        rows["hf"] = run_hf(args, requests, tokens[1])
    print(f"preprocessing: {rate:.1f} images/s on one core ({args.image_size} px, {inputs[0].num_tokens} tokens)")
    for name, row in rows.items():
        print_table(name, [(key, str(value)) for key, value in row.items() if key != "profile"])
    if args.profile:
        print_profile(rows["engine"]["profile"])
    if "hf" in rows:
        print(f"throughput vs HF: {rows['engine']['throughput_tok_s'] / rows['hf']['throughput_tok_s']:.1f}x")
    env = environment()
    bound = least_time_row(args, inputs[0], len(requests[0][1]), rows, args.bound_gpu or env["gpu"])
    print_least_time(bound, rows["engine"]["wall_s"])
    described = "a tiny random Qwen2.5-VL" if args.smoke else f"{Path(args.config).name} shape, random weights"
    result = {
        "env": env,
        "model": f"{described}, {args.dtype}",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "image_tokens": inputs[0].num_tokens,
        "prompt_tokens": len(requests[0][1]),
        "preprocess_images_s_per_core": round(rate, 2),
        "runs": rows,
        "least_time": bound,
        "profile": rows["engine"].pop("profile", None),
    }
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
