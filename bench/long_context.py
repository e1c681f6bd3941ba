"""One long request on one GPU: prefill time (chunked, with a stream of short requests served
beside it) and decode tok/s at full context; HF transformers in the same call where it fits.

    python bench/long_context.py --context 131072
    python bench/long_context.py --context 524288 --kv-cache-dtype fp8
    python bench/long_context.py --context 1048576 --kv-cache-dtype fp8 --fill-cache

Workload (seed 0, random token ids, greedy, ignore_eos, dummy weights of --config): one prompt of
--context tokens generating --decode-tokens; while it prefills, a short request (--short-len tokens,
--short-output out) joins every step, up to --shorts of them, to show the rest of the batch is still
served. Decode tok/s counts the steps where the long request decodes alone. --fill-cache skips the
prefill: random keys and values are written into the KV blocks and registered under the prompt
(gpuworker.engine.filled_context), so only its last tokens are prefilled; decode speed does not depend
on the cached values, but no prefill time is measured and the output says so. A context past the
model's max_position_embeddings runs with allow_long_context. --profile: the torch profiler's top
kernels over the prefill steps. A warm-up (not timed) runs first. Writes
long_context-<context>-<kv cache dtype>[-filled].json, so the three runs can share one $OUT.
"""

from __future__ import annotations

import gc
import random
import time

from common import (
    BENCH_DIR,
    Timer,
    add_engine_options,
    add_kv_cache_dtype_option,
    add_smoke_option,
    attention_heads,
    build_hf_model,
    dummy_engine,
    engine_parser,
    environment,
    free_device_memory,
    load_hf_config,
    print_table,
    synchronize,
    use_smoke_model,
    weight_bytes_per_token,
    write_json,
)

DEFAULT_LONG_CONFIG = BENCH_DIR / "configs" / "llama-3.1-8b-long"
PROFILE_ROWS = 15
# The Triton kernel whose device time --profile sums as the prefill's attention.
ATTENTION_KERNEL = "_prefill_attention_kernel"


def build_engine(args):

    return dummy_engine(
        args,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len or args.context + args.decode_tokens,
        allow_long_context=True,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def run_long(args, engine, prompt: list[int], shorts: list[list[int]]) -> dict:
    """The long request with the short stream beside its prefill; its TTFT, the shorts' latencies
    and the decode steps' rate once it runs alone."""
    from gpuworker.engine import SamplingParams

    long_params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    short_params = SamplingParams(temperature=0.0, max_tokens=args.short_output, ignore_eos=True)
    filled = 0
    if args.fill_cache:
        from gpuworker.engine.filled_context import fill_prefix_cache

        with Timer(args.device) as fill:
            filled = len(fill_prefix_cache(engine, prompt, seed=args.seed)) * engine.config.block_size
    started = time.perf_counter()
    engine.add_request("long", prompt, long_params)
    first_token_s = None
    short_done: dict[str, float] = {}
    short_added: dict[str, float] = {}
    decode_steps, decode_s, generated = 0, 0.0, 0
    profiler = _start_profiler(args)
    while engine.has_unfinished_requests():
        if first_token_s is None and len(short_added) < len(shorts):
            request_id = f"short{len(short_added)}"
            short_added[request_id] = time.perf_counter()
            engine.add_request(request_id, shorts[len(short_added) - 1], short_params)
        alone = first_token_s is not None and len(engine.scheduler.running) == 1
        step_start = time.perf_counter()
        outputs = engine.step()
        synchronize(args.device)
        step_s = time.perf_counter() - step_start
        for out in outputs:
            if out.request_id == "long":
                if first_token_s is None and out.outputs[0].token_ids:
                    first_token_s = time.perf_counter() - started
                    profiler = _stop_profiler(profiler, args)
                    alone = False  # the step that returned the first token was the prefill's
                if out.finished:
                    generated = len(out.outputs[0].token_ids)
            elif out.finished:
                short_done[out.request_id] = time.perf_counter() - short_added[out.request_id]
        if alone:
            decode_steps += 1
            decode_s += step_s
    if generated != args.decode_tokens:
        raise RuntimeError(f"the long request generated {generated} tokens, expected {args.decode_tokens}")
    return {
        "fill_cache": bool(args.fill_cache),
        # The prefill time includes the profiler's overhead where this is true.
        "profiled": bool(args.profile),
        "filled_tokens": filled,
        "fill_s": fill.elapsed if args.fill_cache else None,
        # With --fill-cache this covers only the last tokens' prefill, not the context's.
        "prefill_s": None if args.fill_cache else first_token_s,
        "first_token_s": first_token_s,
        "prefill_tok_s": None if args.fill_cache else len(prompt) / first_token_s,
        "short_requests_served": len(short_done),
        "short_latency_s": sorted(short_done.values()),
        "decode_steps_timed": decode_steps,
        "decode_tok_s": decode_steps / decode_s if decode_steps else None,
        "prefill_profile": profiler if isinstance(profiler, dict) else None,
    }


def _start_profiler(args):
    if not args.profile:
        return None
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.__enter__()
    return profiler


def _stop_profiler(profiler, args) -> dict | None:
    """The profiler's table of the top kernels by device time (CPU time on the CPU), and the
    seconds the prefill attention kernel took in all (device time; None on the CPU)."""
    if profiler is None:
        return None
    profiler.__exit__(None, None, None)
    on_cuda = args.device.startswith("cuda")
    averages = profiler.key_averages()
    attention_us = sum(e.device_time_total for e in averages if ATTENTION_KERNEL in e.key) if on_cuda else None
    return {
        "table": averages.table(sort_by="device_time_total" if on_cuda else "cpu_time_total", row_limit=PROFILE_ROWS),
        "attention_kernel_s": None if attention_us is None else attention_us / 1e6,
    }


def attention_flops(cfg: dict, context: int) -> float:
    """A causal prefill's attention matmuls over `context` tokens: QK^T and PV, 2 FLOPs a
    multiply-add, over the lower triangle, every query head of every layer."""
    heads, _, head_dim = attention_heads(cfg)
    return 2.0 * context * context * heads * head_dim * cfg["num_hidden_layers"]


def run_hf(args, prompt: list[int]) -> dict:
    """transformers (sdpa) on the same prompt: one prefill forward, then --decode-tokens greedy steps
    with its KV cache; skipped with a note where its bf16 cache and activations cannot fit."""
    import torch

    cfg = load_hf_config(args.config)
    _, kv_heads, head_dim = attention_heads(cfg)
    kv_bytes = len(prompt) * cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 2
    if args.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(args.device)
        # Every matrix plus the embedding table (weight_bytes_per_token counts one row of it).
        weights = weight_bytes_per_token(cfg) + cfg["vocab_size"] * cfg["hidden_size"] * 2
        activations = len(prompt) * 3 * cfg["intermediate_size"] * 2
        need = weights + kv_bytes + activations
        if need > 0.9 * free:
            return {
                "skipped": f"needs ~{need / 2**30:.0f} GiB (bf16 KV cache and activations), {free / 2**30:.0f} free"
            }
    model = build_hf_model(args.config, getattr(torch, args.dtype), args.device)
    _hf_generate(model, prompt[:256], 2, args.device)  # warm-up, not timed
    try:
        prefill_s, decode_s = _hf_generate(model, prompt, args.decode_tokens, args.device)
    except torch.OutOfMemoryError as exc:
        return {"skipped": f"out of memory: {str(exc).splitlines()[0]}"}
    finally:
        del model
        gc.collect()
        free_device_memory(args.device)
    return {"prefill_s": prefill_s, "decode_tok_s": args.decode_tokens / decode_s}


def _hf_generate(model, prompt: list[int], steps: int, device: str) -> tuple[float, float]:
    """Seconds of one prefill forward over prompt (its bf16 KV cache kept, the last position's logits
    only; sdpa fused) and of `steps` greedy decode steps after it."""
    import torch

    ids = torch.tensor([prompt], device=device)
    with torch.no_grad(), Timer(device) as prefill:
        out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    del out
    with torch.no_grad(), Timer(device) as decode:
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return prefill.elapsed, decode.elapsed


def main() -> None:
    parser = engine_parser(__doc__)
    parser.set_defaults(config=DEFAULT_LONG_CONFIG)
    add_engine_options(parser, max_num_seqs=16, max_model_len=0)
    add_kv_cache_dtype_option(parser)
    add_smoke_option(parser)
    parser.add_argument("--context", type=int, default=131072, help="the long prompt's tokens")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the prefill chunk")
    parser.add_argument("--fill-cache", action="store_true", help="random KV instead of the prefill")
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--short-len", type=int, default=128)
    parser.add_argument("--short-output", type=int, default=16)
    parser.add_argument("--hf", action="store_true", help="the transformers baseline where it fits")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        use_smoke_model(args)
    vocab = load_hf_config(args.config)["vocab_size"]
    rng = random.Random(args.seed)
    prompt = [rng.randrange(vocab) for _ in range(args.context)]
    shorts = [[rng.randrange(vocab) for _ in range(args.short_len)] for _ in range(args.shorts)]

    engine = build_engine(args)
    warm = [rng.randrange(vocab) for _ in range(2 * args.short_len)]
    engine.generate([warm, warm[: args.short_len]], _greedy(4))
    result = run_long(args, engine, prompt, shorts)
    config = engine.config
    result |= {
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_pool_tokens": config.num_kv_blocks * config.block_size,
        "max_model_len": config.max_model_len,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }
    profile = result["prefill_profile"]
    if profile and profile["attention_kernel_s"] and not args.fill_cache:
        flops = attention_flops(load_hf_config(args.config), args.context)
        profile["attention_tflops"] = flops / profile["attention_kernel_s"] / 1e12
    engine.shutdown()
    del engine
    gc.collect()
    free_device_memory(args.device)
    hf = run_hf(args, prompt) if args.hf else {"skipped": "not asked (--hf)"}
    _report(args, result, hf)


def _greedy(max_tokens: int):
    from gpuworker.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _report(args, result: dict, hf: dict) -> None:
    prefill = (
        "not measured: --fill-cache wrote random KV for "
        f"{result['filled_tokens']} tokens in {result['fill_s']:.1f} s (decode speed does not depend on it)"
        if result["fill_cache"]
        else f"{result['prefill_s']:.2f} s ({result['prefill_tok_s']:.0f} tok/s), chunks of "
        f"{result['max_num_batched_tokens']} tokens"
    )
    decode = result["decode_tok_s"]
    rows = [
        ("workload", f"{args.context} tokens, {args.decode_tokens} out, {args.dtype}, KV {args.kv_cache_dtype}"),
        ("KV pool", f"{result['kv_pool_tokens']} tokens, max_model_len {result['max_model_len']}"),
        ("prefill", prefill),
        ("short requests", f"{result['short_requests_served']} served beside the long prefill"),
        ("decode", f"{decode:.1f} tok/s at full context" if decode else "no step decoded alone"),
        (
            "HF transformers",
            hf.get("skipped") or f"prefill {hf['prefill_s']:.2f} s, decode {hf['decode_tok_s']:.1f} tok/s",
        ),
    ]
    print_table("long context", rows)
    profile = result["prefill_profile"]
    if profile:
        print(profile["table"])
        if profile.get("attention_tflops"):
            print(
                f"prefill attention kernel: {profile['attention_kernel_s']:.2f} s, "
                f"{profile['attention_tflops']:.0f} TFLOP/s (causal QK^T and PV FLOPs; timings under the profiler)"
            )
    write_json(
        f"long_context-{args.context}-{args.kv_cache_dtype}" + ("-filled" if args.fill_cache else ""),
        {"env": environment(), "args": {k: str(v) for k, v in vars(args).items()}, "gpuworker": result, "hf": hf},
    )


if __name__ == "__main__":
    main()
