"""The least time bench/throughput.py's workload can take on a dense model, from its work alone:
every GEMM at a given rate, every decode step's KV read at a given bandwidth, and nothing else
(no norm, rotary, sampling or launch gap; kernels one after another, as in our engine and vLLM).
Issue 21 item 3 asks 12,000 output tok/s of bf16 defaults on the 512-request workload; this says
which GEMM rate and KV bandwidth that needs.

    python bench/throughput_bound.py --num-requests 512 --output-len 256 --gemm-tflops 719 --kv-tbps 4.1

--gemm-tflops: what cuBLAS reached on the prefill GEMMs in bench/throughput.py --profile-steps
(H200, BENCHMARKS.md); --kv-tbps: what the bf16 decode attention reads at (bench/kernel_times.py).
--gpu NAME: the data sheet's dense bf16 peak and memory bandwidth of a GPU in bench/configs/gpu_peaks.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import attention_flops, gpu_peaks, kv_bytes_per_token, load_hf_config, projection_params
from throughput import make_workload

BENCH = Path(__file__).resolve().parent


def workload_work(cfg: dict, requests: list[tuple[list[int], int]], kv_bytes_per_value: int = 2) -> dict:
    """FLOPs of the projections (prefill: every prompt token, lm_head only at the last; decode:
    every later output token, lm_head included), FLOPs of causal prefill attention, and the KV
    bytes the decode steps read (each output token after the first reads its whole context)."""
    projections, lm_head = projection_params(cfg)
    kv_per_token = kv_bytes_per_token(cfg, kv_bytes_per_value)
    work = {"prompt_tokens": 0, "output_tokens": 0, "gemm_flops": 0, "attention_flops": 0, "kv_bytes": 0}
    for prompt, output_len in requests:
        p = len(prompt)
        work["prompt_tokens"] += p
        work["output_tokens"] += output_len
        work["gemm_flops"] += 2 * projections * p + 2 * lm_head + 2 * (projections + lm_head) * (output_len - 1)
        work["attention_flops"] += attention_flops(cfg, p * (p + 1) // 2)  # causal
        # The decode step making output token k (k = 2..n) reads the KV of p + k - 1 positions.
        work["kv_bytes"] += kv_per_token * sum(p + k - 1 for k in range(2, output_len + 1))
    return work


def least_time_s(work: dict, gemm_tflops: float, kv_tbps: float) -> float:
    """GEMMs and prefill attention at gemm_tflops, the decode KV read at kv_tbps, nothing else."""
    return (work["gemm_flops"] + work["attention_flops"]) / (gemm_tflops * 1e12) + work["kv_bytes"] / (kv_tbps * 1e12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=BENCH / "configs" / "llama-3-8b")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gemm-tflops", type=float, default=719.0)
    parser.add_argument("--kv-tbps", type=float, default=4.1)
    parser.add_argument(
        "--gpu",
        choices=sorted(gpu_peaks()),
        help="the GPU's dense bf16 peak and bandwidth instead of the two above",
    )
    parser.add_argument("--target", type=float, default=12_000.0, help="output tok/s to check")
    args = parser.parse_args()
    if args.gpu:
        args.gemm_tflops, args.kv_tbps = gpu_peaks()[args.gpu].tflops, gpu_peaks()[args.gpu].tbps
    cfg = load_hf_config(args.config)
    requests = make_workload(
        args.num_requests, cfg["vocab_size"], args.seed, args.min_len, args.max_len, args.output_len
    )
    work = workload_work(cfg, requests)
    seconds = least_time_s(work, args.gemm_tflops, args.kv_tbps)
    gemm_s = (work["gemm_flops"] + work["attention_flops"]) / (args.gemm_tflops * 1e12)
    # The KV bandwidth the target needs with the GEMMs at --gemm-tflops and everything else free.
    left_s = work["output_tokens"] / args.target - gemm_s
    needed = f"{work['kv_bytes'] / left_s / 1e12:.2f} TB/s" if left_s > 0 else "impossible: the GEMMs alone take longer"
    print(f"{args.num_requests} requests, {work['prompt_tokens']:,} prompt and {work['output_tokens']:,} output tokens")
    print(
        f"GEMMs {work['gemm_flops'] / 1e15:.2f} PFLOP + prefill attention {work['attention_flops'] / 1e15:.3f} "
        f"PFLOP at {args.gemm_tflops:g} TFLOP/s: {gemm_s:.2f} s"
    )
    print(
        f"decode KV reads {work['kv_bytes'] / 1e12:.2f} TB at {args.kv_tbps:g} TB/s: "
        f"{work['kv_bytes'] / (args.kv_tbps * 1e12):.2f} s"
    )
    print(f"least time {seconds:.2f} s: at most {work['output_tokens'] / seconds:,.0f} output tok/s")
    print(f"{args.target:,.0f} tok/s needs the KV read at {needed}")


if __name__ == "__main__":
    main()
