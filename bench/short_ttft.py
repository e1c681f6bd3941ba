"""TTFT of short requests that arrive while long prompts prefill, with the scheduler's short-prompt
share and without it (plain arrival order, the scheduler before issue 21), one fresh engine each.

    python bench/short_ttft.py [--shares 0,0.125] [--num-long 8] [--long-len 7000] [--shorts 6]

Workload (seed 0, random token ids, greedy, ignore_eos): --num-long prompts of --long-len tokens
submitted at once, each generating --long-output tokens; then one prompt of --short-len tokens
(--short-output tokens) submitted before each of the next --shorts steps, while the long prompts
prefill (8 x 7,000 tokens take ~7 steps of the Llama-3-8B shape's 8,192-token budget). Per share:
the short requests' TTFT (the engine's arrival to first-token times) and the steps they waited, the
long requests' TTFT, and the wall time and throughput of the whole run, so the cost of letting short
prompts pass shows beside the gain. A warm-up (not timed) runs first on each engine.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

from common import (
    add_engine_options,
    dummy_engine,
    engine_parser,
    environment,
    free_device_memory,
    load_hf_config,
    print_table,
    write_json,
)


def make_prompts(rng: random.Random, vocab: int, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def run_share(args, share: float, longs: list[list[int]], shorts: list[list[int]]) -> dict:
    from gpuworker.engine import SamplingParams

    engine = dummy_engine(
        args,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        short_prefill_share=share,
        enable_prefix_caching=False,  # random prompts share nothing; keep the hash work out
    )
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate([longs[0], longs[1][: len(shorts[0])]], warm)  # prefill chunks beside decodes, then decodes
    long_params = SamplingParams(temperature=0.0, max_tokens=args.long_output, ignore_eos=True)
    short_params = SamplingParams(temperature=0.0, max_tokens=args.short_output, ignore_eos=True)

    started = time.perf_counter()
    for i, prompt in enumerate(longs):
        engine.add_request(f"long{i}", prompt, long_params)
    steps = 0
    added_at: dict[str, int] = {}
    # Per request: the steps from its submission to the one that returned its first token.
    waited_steps: dict[str, int] = {}
    ttft: dict[str, float] = {}
    generated = 0
    while engine.has_unfinished_requests() or len(added_at) < len(shorts):
        if steps >= 1 and len(added_at) < len(shorts):
            request_id = f"short{len(added_at)}"
            engine.add_request(request_id, shorts[len(added_at)], short_params)
            added_at[request_id] = steps
        outputs = engine.step()
        steps += 1
        for out in outputs:
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = out.metrics.first_token_time - out.metrics.arrival_time
                waited_steps[out.request_id] = steps - added_at.get(out.request_id, 0)
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - started
    expected = len(longs) * args.long_output + len(shorts) * args.short_output
    if generated != expected:
        raise RuntimeError(f"generated {generated} tokens, expected {expected}")
    short_ttft = sorted(ttft[r] for r in added_at)
    long_ttft = [ttft[f"long{i}"] for i in range(len(longs))]
    config = engine.config
    result = {
        "share": share,
        "short_prefill_tokens": engine.scheduler.short_prefill_tokens,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "short_ttft_s": short_ttft,
        "short_ttft_p50_s": statistics.median(short_ttft),
        "short_ttft_max_s": short_ttft[-1],
        "short_waited_steps": [waited_steps[r] for r in added_at],
        "long_ttft_mean_s": statistics.fmean(long_ttft),
        "long_ttft_max_s": max(long_ttft),
        "long_waited_steps": [waited_steps[f"long{i}"] for i in range(len(longs))],
        "steps": steps,
        "seconds": seconds,
        "output_tok_s": generated / seconds,
        "total_tok_s": (generated + sum(map(len, longs)) + sum(map(len, shorts))) / seconds,
    }
    del engine
    gc.collect()
    free_device_memory(args.device)
    return result


def main() -> None:
    parser = engine_parser(__doc__)
    add_engine_options(parser, max_num_seqs=None, max_model_len=8192)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's choice")
    parser.add_argument(
        "--shares",
        default="0,0.125",
        help="comma-separated short_prefill_share values, each on a fresh engine (0: plain order)",
    )
    parser.add_argument("--num-long", type=int, default=8)
    parser.add_argument("--long-len", type=int, default=7000)
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--shorts", type=int, default=6)
    parser.add_argument("--short-len", type=int, default=128)
    parser.add_argument("--short-output", type=int, default=16)
    args = parser.parse_args()

    vocab = load_hf_config(args.config)["vocab_size"]
    rng = random.Random(args.seed)
    longs = make_prompts(rng, vocab, args.num_long, args.long_len)
    shorts = make_prompts(rng, vocab, args.shorts, args.short_len)
    shares = [float(s) for s in args.shares.split(",") if s]
    results = [run_share(args, share, longs, shorts) for share in shares]

    rows = [
        (
            "workload",
            f"{args.num_long} x {args.long_len}-token prompts at once ({args.long_output} out), "
            f"then {args.shorts} x {args.short_len} tokens ({args.short_output} out), one per step; "
            f"{args.dtype}",
        )
    ]
    for r in results:
        label = f"share {r['share']:g}" + (
            " (plain order)" if not r["share"] else f" (<= {r['short_prefill_tokens']} tokens)"
        )
        rows += [
            (
                label,
                f"short TTFT p50 {1e3 * r['short_ttft_p50_s']:.0f} ms, max {1e3 * r['short_ttft_max_s']:.0f} ms; "
                f"waited {r['short_waited_steps']} steps",
            ),
            (
                "",
                f"long TTFT mean {r['long_ttft_mean_s']:.2f} s, max {r['long_ttft_max_s']:.2f} s "
                f"({r['long_waited_steps']} steps); all done in {r['seconds']:.2f} s ({r['steps']} steps), "
                f"{r['total_tok_s']:.0f} total tok/s, {r['output_tok_s']:.0f} output tok/s",
            ),
        ]
    rows.append(
        (
            "engine",
            f"max_num_seqs {results[0]['max_num_seqs']}, max_num_batched_tokens {results[0]['max_num_batched_tokens']}",
        )
    )
    print_table("short requests behind long prefills", rows)
    write_json(
        "short_ttft", {"env": environment(), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    )


if __name__ == "__main__":
    main()
