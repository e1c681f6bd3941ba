"""Offline throughput: many random-token requests submitted at once, against HF transformers.

    python bench/throughput.py [--num-requests 1024] [--hf-requests 128] [--output-len 256]
        [--sampling greedy,t0.8-k200,t0.7-p0.9,t0.8-p0.95,t0.8-p0.95-seeded]
    python bench/throughput.py --smoke [--config ...]  # CPU, float32, that architecture at a tiny size

Default workload (seed 0): 1024 requests, prompts of 100-1024 random tokens, outputs of 100-1024
tokens with ignore_eos, all submitted at once. The HF baseline runs `generate` on static, padded
batches of the first --hf-requests requests (the whole set takes HF far longer than a device call
allows); our engine is timed on that same subset too, so the ratio compares identical work.
--output-len fixes every output length instead. --sampling runs the whole workload once per mode on
the same engine and prints each against the first (HF and the subset only for the first).

The engine runs with its defaults for the device (gpuworker/engine/sizing.py): on an H200 with the
Llama-3-8B shape, 1024 sequences and 8192 tokens per step, which the KV pool holds without
preemption on this workload (the table prints the limits, preemptions and the pool's peak use).
Fewer concurrent sequences leave the end of the run in small, weight-bound decode batches
(--max-num-seqs 512: 11.5k tok/s).
"""

from __future__ import annotations

import random
import time

import torch

from common import (
    Profiled,
    Timer,
    add_engine_options,
    add_kv_cache_dtype_option,
    add_parallel_option,
    add_sampling_option,
    add_smoke_option,
    build_hf_model,
    dummy_engine,
    engine_parser,
    environment,
    free_device_memory,
    load_hf_config,
    print_table,
    sampling_modes,
    sampling_params,
    use_smoke_model,
    write_json,
)


def make_workload(num_requests: int, vocab: int, seed: int, lo: int, hi: int, output_len: int | None = None):
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len, random_output_len = rng.randint(lo, hi), rng.randint(lo, hi)
        requests.append(([rng.randrange(vocab) for _ in range(prompt_len)], output_len or random_output_len))
    return requests


def run_engine(engine, requests, profile_steps: tuple[int, int] | None = None, mode: str = "greedy") -> dict:
    profiler: Profiled | None = None

    # Per step: wall time of the step() call, and what the step it completed ran.
    trace: list[tuple[float, int, int]] = []
    preemptions_before = engine.scheduler.num_preemptions
    peak_kv_usage = 0.0
    with Timer(str(engine.device)) as t:
        for i, (prompt, output_len) in enumerate(requests):
            # Offline: only the final outputs are read (as LLMEngine.generate does).
            engine.add_request(
                f"req-{i}",
                prompt,
                sampling_params(mode, i, max_tokens=output_len, ignore_eos=True, output_kind="final_only"),
            )
        generated = 0
        while engine.has_unfinished_requests():
            if profile_steps and len(trace) == profile_steps[0]:
                profiler = start_profiler()
            if profiler is not None and len(trace) == profile_steps[1]:
                report_profile(profiler, profile_steps[1] - profile_steps[0])
                profiler = None
            started = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
            stats = engine.last_step_stats
            peak_kv_usage = max(peak_kv_usage, stats.kv_cache_usage if stats else 0.0)
            trace.append(
                (
                    time.perf_counter() - started,
                    stats.num_decode_tokens if stats else 0,
                    stats.num_prefill_tokens if stats else 0,
                )
            )
    expected = sum(n for _, n in requests)
    if generated != expected:
        raise RuntimeError(f"engine generated {generated} tokens, expected {expected}")
    prompt_tokens = sum(len(p) for p, _ in requests)
    return {
        "requests": len(requests),
        "seconds": t.elapsed,
        "output_tok_s": expected / t.elapsed,
        "total_tok_s": (expected + prompt_tokens) / t.elapsed,
        "phases": step_phases(trace),
        "steps": len(trace),
        "preemptions": engine.scheduler.num_preemptions - preemptions_before,
        "peak_kv_cache_usage": peak_kv_usage,
    }


def start_profiler() -> Profiled:
    return Profiled("cuda").start()


def report_profile(profiled: Profiled, steps: int) -> None:
    """GPU busy time against wall time over a window of steps, and the largest kernels."""
    profiled.stop()
    wall = profiled.wall_s
    kernels = profiled.top_kernels(None)
    busy = sum(seconds for _, seconds, _ in kernels)
    rows = [
        (
            f"{steps} steps",
            f"wall {1e3 * wall / steps:.2f} ms/step, GPU busy {1e3 * busy / steps:.2f} ms/step "
            f"({100 * busy / wall:.0f}%)",
        )
    ]
    for name, seconds, calls in kernels[:14]:
        rows.append((name[:60], f"{1e3 * seconds / steps:.3f} ms/step x{calls / steps:.0f}"))
    rows += [
        (f"host: {name[:54]}", f"{1e3 * seconds / steps:.3f} ms/step x{calls / steps:.0f}")
        for name, seconds, calls in profiled.top_kernels(10, host=True)
    ]
    print_table("profiled window", rows)


def step_phases(trace: list[tuple[float, int, int]]) -> dict:
    """Where the wall time went: steps that ran prefill tokens (mixed with decodes or not) and
    pure decode steps, split by how many sequences they decoded."""
    kinds: dict[str, list[float]] = {}
    for wall, decodes, prefills in trace:
        if prefills:
            kind = "with prefill"
        else:
            kind = next(f"decode <= {b}" for b in (8, 64, 128, 256, 384, 512, 768, 1 << 30) if decodes <= b)
        entry = kinds.setdefault(kind, [0, 0.0, 0, 0])
        entry[0] += 1
        entry[1] += wall
        entry[2] += decodes
        entry[3] += prefills
    return {
        kind: {
            "steps": n,
            "seconds": round(sec, 3),
            "ms_per_step": round(1e3 * sec / n, 2),
            "decode_tokens": d,
            "prefill_tokens": p,
        }
        for kind, (n, sec, d, p) in sorted(kinds.items())
    }


@torch.inference_mode()
def run_hf(args, requests) -> dict:
    model = build_hf_model(args.config, getattr(torch, args.dtype), args.device)
    generated = prompt_tokens = 0
    with Timer(args.device) as t:
        for start in range(0, len(requests), args.hf_batch_size):
            batch = requests[start : start + args.hf_batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(batch):  # left padding, as decoder-only generate wants
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            new = max(n for _, n in batch)
            model.generate(
                ids.to(args.device),
                attention_mask=mask.to(args.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            generated += sum(n for _, n in batch)  # only the tokens each request asked for count
            prompt_tokens += sum(len(p) for p, _ in batch)
    del model
    free_device_memory(args.device)
    return {
        "requests": len(requests),
        "batch_size": args.hf_batch_size,
        "seconds": t.elapsed,
        "output_tok_s": generated / t.elapsed,
        "total_tok_s": (generated + prompt_tokens) / t.elapsed,
    }


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=None, help="every output this long (default: random)")
    add_engine_options(parser, max_num_seqs=None, max_model_len=2048)
    add_kv_cache_dtype_option(parser)
    add_parallel_option(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's choice")
    parser.add_argument("--hf-requests", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--profile-steps", default="", help="A:B profiles steps A to B of the full run (torch profiler; slows them)"
    )
    add_sampling_option(parser)
    add_smoke_option(parser)
    args = parser.parse_args()
    modes = sampling_modes(args.sampling)
    if args.smoke:
        use_smoke_model(args)
        args.num_requests, args.min_len, args.max_len, args.max_model_len = 6, 8, 24, 256
    if args.profile_steps and torch.device(args.device).type != "cuda":
        parser.error(f"--profile-steps profiles CUDA kernels: it needs a CUDA --device, not {args.device}")

    from gpuworker.engine import SamplingParams

    cfg = load_hf_config(args.config)
    requests = make_workload(
        args.num_requests, cfg["vocab_size"], args.seed, args.min_len, args.max_len, args.output_len
    )
    engine = dummy_engine(
        args,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts share nothing; keep the hash work out
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
    )
    t0 = time.perf_counter()  # warm-up: kernel compilation and graph capture stay out of the figures
    warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # Steps with prefill chunks and decodes mixed (eager kernels), then a lone request (the one-row
    # projections and lm_head), so that no kernel variant first compiles inside the timed run.
    engine.generate([p for p, _ in requests[:24]], warm)
    engine.generate([requests[0][0]], warm)
    warmup_s = time.perf_counter() - t0

    window = tuple(int(x) for x in args.profile_steps.split(":")) if args.profile_steps else None
    by_mode = {}
    for mode in modes:
        if mode != "greedy":  # the sampler's kernel variants compile outside the timed run
            engine.generate([p for p, _ in requests[:24]], sampling_params(mode, 0, max_tokens=16, ignore_eos=True))
        by_mode[mode] = run_engine(engine, requests, window, mode)
    ours = by_mode[modes[0]]
    engine_kv_blocks = engine.config.num_kv_blocks
    engine_kv_tokens = engine_kv_blocks * engine.config.block_size
    limits = (engine.config.max_num_seqs, engine.config.max_num_batched_tokens)
    graph_capture_s = engine.load_timings.get("cuda_graphs", 0.0)
    subset = requests[: args.hf_requests]
    ours_subset = None if args.skip_hf else run_engine(engine, subset, mode=modes[0])
    del engine
    free_device_memory(args.device)
    hf = None if args.skip_hf else run_hf(args, subset)

    outputs = f"output {args.output_len}" if args.output_len else f"output {args.min_len}-{args.max_len}"
    rows = [
        (
            "workload",
            f"{args.num_requests} requests, prompt {args.min_len}-{args.max_len} tokens, {outputs}, "
            f"seed {args.seed}, {args.dtype} on {args.device}, KV cache {args.kv_cache_dtype}, "
            f"tensor parallel {args.tensor_parallel_size} ({args.expert_parallel})",
        ),
        (
            f"gpuworker, {modes[0]}",
            f"{ours['output_tok_s']:.0f} output tok/s, {ours['total_tok_s']:.0f} total tok/s "
            f"({ours['seconds']:.1f} s; warm-up {warmup_s:.1f} s)",
        ),
    ]
    rows += [
        (
            f"gpuworker, {mode}",
            f"{by_mode[mode]['output_tok_s']:.0f} output tok/s "
            f"({100 * by_mode[mode]['output_tok_s'] / ours['output_tok_s']:.1f}% of {modes[0]}; "
            f"{by_mode[mode]['seconds']:.1f} s)",
        )
        for mode in modes[1:]
    ]
    rows += [
        (
            "engine",
            f"max_num_seqs {limits[0]}, max_num_batched_tokens {limits[1]}, {ours['steps']} steps, "
            f"{ours['preemptions']} preemptions, KV pool {engine_kv_tokens} tokens "
            f"({engine_kv_blocks} blocks), "
            f"peak use {100 * ours['peak_kv_cache_usage']:.0f}%, CUDA graphs captured in "
            f"{graph_capture_s:.1f} s",
        ),
    ]
    if hf:
        rows += [
            (f"gpuworker, first {len(subset)}", f"{ours_subset['output_tok_s']:.0f} output tok/s"),
            (
                f"HF generate, first {len(subset)}",
                f"{hf['output_tok_s']:.0f} output tok/s "
                f"(static batches of {args.hf_batch_size}, padded; {hf['seconds']:.1f} s)",
            ),
            ("ratio (same requests)", f"{ours_subset['output_tok_s'] / hf['output_tok_s']:.1f}x"),
        ]
    print_table("offline throughput", rows)
    print_table(
        "where the wall time went (all requests)",
        [
            (
                kind,
                f"{v['steps']} steps, {v['seconds']:.1f} s, {v['ms_per_step']:.2f} ms/step, "
                f"{v['decode_tokens']} decode + {v['prefill_tokens']} prefill tokens",
            )
            for kind, v in ours["phases"].items()
        ],
    )
    write_json(
        "throughput",
        {
            "env": environment(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "gpuworker": ours,
            "gpuworker_by_sampling": by_mode,
            "gpuworker_subset": ours_subset,
            "hf_subset": hf,
            "warmup_s": warmup_s,
            "max_num_seqs": limits[0],
            "max_num_batched_tokens": limits[1],
            "graph_capture_s": graph_capture_s,
            "kv_cache_tokens": engine_kv_tokens,
        },
    )


if __name__ == "__main__":
    main()
