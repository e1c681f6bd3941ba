"""Vision serving: Qwen2.5-VL through the engine against HF transformers in the same run (random
weights of --config's shape; images are random noise of --image-size pixels a side).

    python bench/vision.py [--config bench/configs/qwen2.5-vl-7b] [--requests 256] [--output 128]

Figures: preprocessing images per second on one CPU core (transformers' image processor, as the
serving side runs it in its process pool); the engine's TTFT for one image and a --question-tokens
question (median of --ttft-runs, each a new image: the encoder runs every time); the engine's
throughput for --requests requests each with its own image and --output tokens out (greedy,
ignore_eos), with the device's busy share over the run from torch.cuda's utilisation samples; HF's
TTFT and throughput with batches of --hf-batch requests (generate, greedy).
"""

from __future__ import annotations

import gc
import statistics
import threading
import time

import numpy as np

from common import (
    add_engine_options,
    dummy_engine,
    engine_parser,
    environment,
    free_device_memory,
    print_table,
    write_json,
)

DEFAULT_VISION_CONFIG = "bench/configs/qwen2.5-vl-7b"


def noise_images(count: int, size: int, seed: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def preprocess_rate(config_dir: str, images: list) -> float:
    from gpuworker.engine.multimodal import preprocess_image

    preprocess_image(config_dir, images[0])
    started = time.perf_counter()
    for image in images:
        preprocess_image(config_dir, image)
    return len(images) / (time.perf_counter() - started)


def prompt_ids(image, vision, question: int, seed: int) -> list[int]:
    from gpuworker.engine.multimodal import expand_image_tokens

    rng = np.random.default_rng(seed)
    text = rng.integers(10, min(20000, vision.image_token_id - 8), question).tolist()  # plain text ids
    ids = [vision.vision_start_token_id, vision.image_token_id, vision.vision_start_token_id + 1] + text
    return expand_image_tokens(ids, [image], vision.image_token_id)


class BusySampler:
    """The GPU's utilisation (NVML, through torch.cuda.utilization) sampled every 50 ms."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import torch

        while not self._stop.wait(0.05):
            try:
                self.samples.append(torch.cuda.utilization())
            except Exception:  # no NVML: no figure
                return

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def busy(self) -> float | None:
        return round(statistics.mean(self.samples) / 100, 3) if self.samples else None


def run_engine(args, inputs: list, vision) -> dict:
    from gpuworker.engine import SamplingParams

    engine = dummy_engine(
        args,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.generate([prompt_ids(inputs[0], vision, args.question_tokens, 0)], one, images=[[inputs[0]]])  # warm-up
    ttfts = []
    for i in range(1, 1 + args.ttft_runs):
        started = time.perf_counter()
        engine.generate([prompt_ids(inputs[i], vision, args.question_tokens, i)], one, images=[[inputs[i]]])
        ttfts.append(time.perf_counter() - started)
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    work = inputs[1 + args.ttft_runs :][: args.requests]
    prompts = [prompt_ids(image, vision, args.question_tokens, 1000 + i) for i, image in enumerate(work)]
    with BusySampler() as sampler:
        started = time.perf_counter()
        outputs = engine.generate(prompts, params, images=[[image] for image in work])
        elapsed = time.perf_counter() - started
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    engine.shutdown()
    return {
        "ttft_ms": round(1000 * statistics.median(ttfts), 1),
        "throughput_tok_s": round(tokens / elapsed, 1),
        "requests_s": round(len(work) / elapsed, 2),
        "gpu_busy": sampler.busy,
        "wall_s": round(elapsed, 2),
    }


def run_hf(args, inputs: list, vision) -> dict:
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(args.config))
    with torch.device(args.device):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=getattr(torch, args.dtype))
    model.eval()

    def generate(batch: list, max_new: int) -> int:
        ids = torch.tensor([prompt_ids(image, vision, args.question_tokens, i) for i, image in enumerate(batch)])
        out = model.generate(
            ids.to(args.device),
            attention_mask=torch.ones_like(ids).to(args.device),
            pixel_values=torch.cat([image.pixel_values for image in batch]).to(args.device, model.dtype),
            image_grid_thw=torch.tensor([image.grid_thw for image in batch], device=args.device),
            mm_token_type_ids=(ids == vision.image_token_id).int().to(args.device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
        )
        return (out.shape[1] - ids.shape[1]) * len(batch)

    with torch.inference_mode():
        generate(inputs[:1], 1)
        ttfts = []
        for i in range(1, 1 + args.ttft_runs):
            started = time.perf_counter()
            generate(inputs[i : i + 1], 1)
            ttfts.append(time.perf_counter() - started)
        work = inputs[1 + args.ttft_runs :][: args.hf_requests or args.requests]
        started, tokens = time.perf_counter(), 0
        for i in range(0, len(work), args.hf_batch):
            tokens += generate(work[i : i + args.hf_batch], args.output)
        elapsed = time.perf_counter() - started
    return {
        "ttft_ms": round(1000 * statistics.median(ttfts), 1),
        "throughput_tok_s": round(tokens / elapsed, 1),
        "requests_s": round(len(work) / elapsed, 2),
        "wall_s": round(elapsed, 2),
    }


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
    parser.add_argument("--json", default="vision", help="result file name under bench/results (or $OUT)")
    args = parser.parse_args()

    from gpuworker.engine.multimodal import preprocess_image
    from gpuworker.models.loader import load_model_config

    vision = load_model_config(args.config).vision
    images = noise_images(1 + args.ttft_runs + args.requests, args.image_size, args.seed)
    rate = preprocess_rate(str(args.config), images[: min(8, len(images))])
    inputs = [preprocess_image(args.config, image) for image in images]
    rows = {"engine": run_engine(args, inputs, vision)}
    free_device_memory(args.device)
    if not args.skip_hf:
        rows["hf"] = run_hf(args, inputs, vision)
        gc.collect()
    print(f"preprocessing: {rate:.1f} images/s on one core ({args.image_size} px, {inputs[0].num_tokens} tokens)")
    for name, row in rows.items():
        print_table(name, [(key, str(value)) for key, value in row.items()])
    if "hf" in rows:
        print(f"throughput vs HF: {rows['engine']['throughput_tok_s'] / rows['hf']['throughput_tok_s']:.1f}x")
    result = {"env": environment(), "preprocess_images_s_per_core": round(rate, 2), "runs": rows}
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
