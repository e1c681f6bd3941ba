"""Batch-1 decode latency: tokens/s and achieved weight-read bandwidth, against HF transformers.

    python bench/latency.py [--config bench/configs/llama-3-8b] [--prompt-len 128] [--output-len 512]
        [--sampling greedy,t0.8-k200,t0.7-p0.9,t0.8-p0.95-seeded]
    python bench/latency.py --config bench/configs/llama-3-8b-fp8 --skip-hf  # or llama-3-8b-awq
    python bench/latency.py --smoke [--config ...]  # CPU, float32, that architecture at a tiny size

Weights are random (load_format="dummy"): speed does not depend on their values. --sampling runs
each mode in turn on one engine and prints each against greedy (the first mode), HF only for greedy.
"""

from __future__ import annotations

import random
import time

import torch

from common import (
    Timer,
    add_kv_cache_dtype_option,
    add_parallel_option,
    add_sampling_option,
    add_smoke_option,
    build_hf_model,
    copy_bandwidth_gbs,
    engine_parser,
    environment,
    free_device_memory,
    load_hf_config,
    print_table,
    sampling_modes,
    sampling_params,
    use_smoke_model,
    weight_bytes_per_token,
    write_json,
)


def engine_decode_rates(args, prompt: list[int], modes: list[str]) -> dict[str, dict]:
    from gpuworker.engine import LLMEngine

    engine = LLMEngine(
        str(args.config),
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        seed=0,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
    )
    rates = {}
    for mode in modes:
        # Warm-up per mode: the sampler's kernel variants compile outside the timed runs.
        engine.generate([prompt[:16]], sampling_params(mode, 0, max_tokens=32, ignore_eos=True))
        rates[mode] = decode_rate(args, engine, prompt, mode)
    del engine
    free_device_memory(args.device)
    return rates


def decode_rate(args, engine, prompt: list[int], mode: str) -> dict:
    runs = []
    for run in range(args.repeats):
        params = sampling_params(mode, run, max_tokens=args.output_len, ignore_eos=True)
        engine.add_request(f"lat-{mode}-{run}", prompt, params)
        token_times = []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            token_times.append(time.perf_counter())
        ttft = token_times[0] - t0
        decode_s = token_times[-1] - token_times[0]
        runs.append({"ttft_s": ttft, "decode_tok_s": (len(token_times) - 1) / decode_s})
    runs.sort(key=lambda r: r["decode_tok_s"])
    return runs[len(runs) // 2]


@torch.inference_mode()
def hf_decode_rate(args, prompt: list[int]) -> dict:
    model = build_hf_model(args.config, getattr(torch, args.dtype), args.device)
    ids = torch.tensor([prompt], device=args.device)

    def gen(n: int) -> float:
        with Timer(args.device) as t:
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return t.elapsed

    gen(8)
    first = min(gen(1) for _ in range(3))
    full = gen(args.hf_output_len)
    # Rebound to None rather than deleted: ruff reads a name deleted after a lambda or closure that
    # uses it as undefined there (F821); the memory goes back all the same.
    model = None
    free_device_memory(args.device)
    return {"ttft_s": first, "decode_tok_s": (args.hf_output_len - 1) / (full - first)}


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--hf-output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    add_kv_cache_dtype_option(parser)
    add_parallel_option(parser)
    add_sampling_option(parser)
    add_smoke_option(parser)
    args = parser.parse_args()
    modes = sampling_modes(args.sampling)
    if args.smoke:
        use_smoke_model(args)
        args.prompt_len, args.output_len, args.hf_output_len, args.repeats = 16, 8, 8, 1

    cfg = load_hf_config(args.config)
    rng = random.Random(0)
    prompt = [rng.randrange(cfg["vocab_size"]) for _ in range(args.prompt_len)]
    weight_gb = weight_bytes_per_token(cfg) / 1e9
    # A GPU figure: the CPU has no copy engine worth comparing the decode's bandwidth with.
    copy_gbs = copy_bandwidth_gbs() if torch.device(args.device).type == "cuda" else None

    rates = engine_decode_rates(args, prompt, modes)
    ours = rates[modes[0]]
    hf = None if args.skip_hf or modes[0] != "greedy" else hf_decode_rate(args, prompt)

    ours_bw = weight_gb * ours["decode_tok_s"]
    rows = [
        (
            "workload",
            f"batch 1, prompt {args.prompt_len}, {args.output_len} output tokens, {args.dtype} on "
            f"{args.device}, KV cache {args.kv_cache_dtype}, "
            f"tensor parallel {args.tensor_parallel_size} ({args.expert_parallel})",
        ),
        ("weights read per token", f"{weight_gb:.2f} GB"),
        (
            "device copy bandwidth",
            f"{copy_gbs:.0f} GB/s (bound {copy_gbs / weight_gb:.0f} tok/s)" if copy_gbs else f"n/a ({args.device})",
        ),
        (
            f"gpuworker decode, {modes[0]}",
            f"{ours['decode_tok_s']:.1f} tok/s, {ours_bw:.0f} GB/s"
            + (f" ({100 * ours_bw / copy_gbs:.0f}% of copy)" if copy_gbs else "")
            + f", TTFT {1e3 * ours['ttft_s']:.1f} ms",
        ),
    ]
    rows += [
        (
            f"gpuworker decode, {mode}",
            f"{rates[mode]['decode_tok_s']:.1f} tok/s "
            f"({100 * rates[mode]['decode_tok_s'] / ours['decode_tok_s']:.1f}% of {modes[0]}), "
            f"TTFT {1e3 * rates[mode]['ttft_s']:.1f} ms",
        )
        for mode in modes[1:]
    ]
    if hf:
        rows += [
            ("HF transformers decode", f"{hf['decode_tok_s']:.1f} tok/s, TTFT {1e3 * hf['ttft_s']:.1f} ms"),
            ("ratio", f"{ours['decode_tok_s'] / hf['decode_tok_s']:.2f}x"),
        ]
    print_table("latency (batch 1)", rows)
    write_json(
        "latency",
        {
            "env": environment(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "weight_gb_per_token": weight_gb,
            "copy_bandwidth_gbs": copy_gbs,
            "gpuworker": ours,
            "gpuworker_by_sampling": rates,
            "gpuworker_weight_bandwidth_gbs": ours_bw,
            "hf": hf,
        },
    )


if __name__ == "__main__":
    main()
