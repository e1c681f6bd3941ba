"""The least time bench/vision.py's workload allows on a GPU, from its work alone: the vision tower's
and the LLM prefill's FLOPs at the GPU's dense bf16 peak, and each decode step at the larger of its
FLOPs at that peak and its bytes (the LLM's weights once, every sequence's KV) at the memory
bandwidth. The phases follow one another; no norm, rotary, sampling or launch gap is counted.

    python bench/vision_bound.py --gpu "NVIDIA H100 80GB HBM3" [--requests 256] [--decode-batch 256]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import (
    GpuPeak,
    attention_flops,
    gpu_peaks,
    kv_bytes_per_token,
    load_hf_config,
    projection_params,
    roofline_s,
    weight_bytes_per_token,
)

BENCH = Path(__file__).resolve().parent


def text_config(cfg: dict) -> dict:
    """The LLM's config: Qwen2.5-VL's text_config, or the top level of a flat config."""
    return cfg.get("text_config") or cfg


def vision_matrices(vcfg: dict) -> tuple[int, int]:
    """(weights each patch multiplies through: the patch embedding and every block's qkv, proj and
    gated MLP; weights each merged token multiplies through: the merger's two layers)."""
    h, i = vcfg["hidden_size"], vcfg["intermediate_size"]
    patch = vcfg.get("in_channels", 3) * vcfg["temporal_patch_size"] * vcfg["patch_size"] ** 2
    merged = h * vcfg["spatial_merge_size"] ** 2
    return patch * h + vcfg["depth"] * (4 * h * h + 3 * h * i), merged * (merged + vcfg["out_hidden_size"])


def vision_params(vcfg: dict) -> int:
    """Every parameter of the vision tower: the matrices, each block's two RMSNorms and biases (qkv,
    proj, gate, up, down), the merger's RMSNorm and biases."""
    h, i = vcfg["hidden_size"], vcfg["intermediate_size"]
    merged = h * vcfg["spatial_merge_size"] ** 2
    per_patch, per_merged_token = vision_matrices(vcfg)
    vectors = vcfg["depth"] * (7 * h + 2 * i) + h + merged + vcfg["out_hidden_size"]
    return per_patch + per_merged_token + vectors


def window_lengths(vcfg: dict, grid_h: int, grid_w: int) -> list[int]:
    """Patches in each attention window of one frame: windows of window_size pixels a side over the
    merged grid, the last in a row or column cut short where the grid ends."""
    merge = vcfg["spatial_merge_size"]
    unit = vcfg["window_size"] // merge // vcfg["patch_size"]  # merged tokens a window side

    def sides(n: int) -> list[int]:
        return [unit] * (n // unit) + ([n % unit] if n % unit else [])

    return [rows * cols * merge * merge for rows in sides(grid_h // merge) for cols in sides(grid_w // merge)]


def vision_flops(vcfg: dict, grid_thw: tuple[int, int, int]) -> int:
    """FLOPs of one image (or video) through the vision tower: its matrices, attention within
    windows, and full attention over each frame in the fullatt_block_indexes blocks."""
    t, grid_h, grid_w = grid_thw
    patches = t * grid_h * grid_w
    per_patch, per_merged_token = vision_matrices(vcfg)
    full = len(vcfg.get("fullatt_block_indexes") or ())
    windowed_pairs = t * sum(n * n for n in window_lengths(vcfg, grid_h, grid_w))
    full_pairs = t * (grid_h * grid_w) ** 2
    pairs = (vcfg["depth"] - full) * windowed_pairs + full * full_pairs
    return (
        2 * per_patch * patches
        + 2 * per_merged_token * patches // vcfg["spatial_merge_size"] ** 2
        + (4 * vcfg["hidden_size"] * pairs)
    )


def prefill_flops(text: dict, prompt_len: int) -> int:
    """One prompt through the LLM: every token's projections, lm_head at the last, causal attention."""
    projections, lm_head = projection_params(text)
    return 2 * projections * prompt_len + 2 * lm_head + attention_flops(text, prompt_len * (prompt_len + 1) // 2)


def decode_s(text: dict, prompt_len: int, output_len: int, requests: int, batch: int, peak: GpuPeak) -> float:
    """The decode steps of `requests` sequences in waves of `batch`: each step reads the weights
    once and every sequence's KV, and multiplies every sequence through the weights and its context."""
    projections, lm_head = projection_params(text)
    weights, kv = weight_bytes_per_token(text), kv_bytes_per_token(text)
    waves = [batch] * (requests // batch) + ([requests % batch] if requests % batch else [])
    total = 0.0
    for n in waves:
        for k in range(2, output_len + 1):  # the first output token comes with the prefill
            context = prompt_len + k - 1
            flops = n * (2 * (projections + lm_head) + attention_flops(text, context))
            total += roofline_s(flops, weights + n * kv * context, peak.tflops, peak.tbps)
    return total


def least_time(cfg: dict, workload: dict, peak: GpuPeak) -> dict:
    """workload: requests, grid_thw (each request's image), prompt_tokens, output_tokens (each
    request's) and decode_batch. Seconds per phase and in all, and the output tok/s they allow."""
    text, requests = text_config(cfg), workload["requests"]
    vision_s = requests * vision_flops(cfg["vision_config"], workload["grid_thw"]) / (peak.tflops * 1e12)
    prefill_s = requests * prefill_flops(text, workload["prompt_tokens"]) / (peak.tflops * 1e12)
    decode = decode_s(
        text, workload["prompt_tokens"], workload["output_tokens"], requests, workload["decode_batch"], peak
    )
    seconds = vision_s + prefill_s + decode
    return {
        "tflops": peak.tflops,
        "tbps": peak.tbps,
        "decode_batch": workload["decode_batch"],
        # Four significant figures: a tiny model's least time is microseconds.
        "vision_s": float(f"{vision_s:.4g}"),
        "prefill_s": float(f"{prefill_s:.4g}"),
        "decode_s": float(f"{decode:.4g}"),
        "least_time_s": float(f"{seconds:.4g}"),
        "max_throughput_tok_s": float(f"{requests * workload['output_tokens'] / seconds:.4g}"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=BENCH / "configs" / "qwen2.5-vl-7b")
    parser.add_argument("--gpu", choices=sorted(gpu_peaks()), required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--grid", type=int, nargs=3, default=(1, 74, 74), help="an image's patch grid (t h w)")
    parser.add_argument("--prompt-tokens", type=int, default=1435)
    parser.add_argument("--decode-batch", type=int, default=None, help="default: every request at once")
    args = parser.parse_args()
    workload = {
        "requests": args.requests,
        "grid_thw": tuple(args.grid),
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output,
        "decode_batch": args.decode_batch or args.requests,
    }
    for key, value in least_time(load_hf_config(args.config), workload, gpu_peaks()[args.gpu]).items():
        print(f"{key:22s}{value}")


if __name__ == "__main__":
    main()
