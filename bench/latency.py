"""Batch-1 decode latency: tokens/s and achieved weight-read bandwidth, against HF transformers.

    python bench/latency.py [--config bench/configs/llama-3-8b] [--prompt-len 128] [--output-len 512]
    python bench/latency.py --config bench/configs/llama-3-8b-fp8 --skip-hf  # or llama-3-8b-awq

Weights are random (load_format="dummy"): speed does not depend on their values.
"""

from __future__ import annotations

import random
import time

import torch

from common import (Timer, build_hf_model, copy_bandwidth_gbs, engine_parser, environment, load_hf_config, print_table,
                    weight_bytes_per_token, write_json)


def engine_decode_rate(args, prompt: list[int]) -> dict:
    from gpuworker.engine import LLMEngine, SamplingParams

    engine = LLMEngine(
        str(args.config), device="cuda", dtype=args.dtype, load_format="dummy",
        max_num_seqs=8, max_num_batched_tokens=2048, seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine.generate([prompt[:16]], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))

    runs = []
    for run in range(args.repeats):
        engine.add_request(f"lat-{run}", prompt, params)
        token_times = []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            token_times.append(time.perf_counter())
        ttft = token_times[0] - t0
        decode_s = token_times[-1] - token_times[0]
        runs.append({"ttft_s": ttft, "decode_tok_s": (len(token_times) - 1) / decode_s})
    runs.sort(key=lambda r: r["decode_tok_s"])
    best = runs[len(runs) // 2]
    del engine
    torch.cuda.empty_cache()
    return best


@torch.inference_mode()
def hf_decode_rate(args, prompt: list[int]) -> dict:
    model = build_hf_model(args.config, getattr(torch, args.dtype))
    ids = torch.tensor([prompt], device="cuda")

    def gen(n: int) -> float:
        with Timer() as t:
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return t.elapsed

    gen(8)
    first = min(gen(1) for _ in range(3))
    full = gen(args.hf_output_len)
    del model
    torch.cuda.empty_cache()
    return {"ttft_s": first, "decode_tok_s": (args.hf_output_len - 1) / (full - first)}


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--hf-output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()

    cfg = load_hf_config(args.config)
    rng = random.Random(0)
    prompt = [rng.randrange(cfg["vocab_size"]) for _ in range(args.prompt_len)]
    weight_gb = weight_bytes_per_token(cfg) / 1e9
    copy_gbs = copy_bandwidth_gbs()

    ours = engine_decode_rate(args, prompt)
    hf = None if args.skip_hf else hf_decode_rate(args, prompt)

    ours_bw = weight_gb * ours["decode_tok_s"]
    rows = [
        ("workload", f"batch 1, prompt {args.prompt_len}, {args.output_len} output tokens, {args.dtype}"),
        ("weights read per token", f"{weight_gb:.2f} GB"),
        ("device copy bandwidth", f"{copy_gbs:.0f} GB/s (bound {copy_gbs / weight_gb:.0f} tok/s)"),
        ("gpuworker decode", f"{ours['decode_tok_s']:.1f} tok/s, {ours_bw:.0f} GB/s "
         f"({100 * ours_bw / copy_gbs:.0f}% of copy), TTFT {1e3 * ours['ttft_s']:.1f} ms"),
    ]
    if hf:
        rows += [
            ("HF transformers decode", f"{hf['decode_tok_s']:.1f} tok/s, TTFT {1e3 * hf['ttft_s']:.1f} ms"),
            ("ratio", f"{ours['decode_tok_s'] / hf['decode_tok_s']:.2f}x"),
        ]
    print_table("latency (batch 1)", rows)
    write_json("latency", {
        "env": environment(), "args": {k: str(v) for k, v in vars(args).items()},
        "weight_gb_per_token": weight_gb, "copy_bandwidth_gbs": copy_gbs,
        "gpuworker": ours, "gpuworker_weight_bandwidth_gbs": ours_bw, "hf": hf,
    })


if __name__ == "__main__":
    main()
