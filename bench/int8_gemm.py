"""INT8 W8A8 GEMM at Llama-3-8B's projections: for each row count, cuBLAS bf16 F.linear against the
INT8 path a projection runs (per-token quantizer + the Triton int8 x int8 -> int32 GEMM), the GEMM
alone, and torch._int_mm (cuBLASLt's INT8 GEMM, int32 out, unscaled) as a ceiling.

    PYTHONPATH=. python bench/int8_gemm.py                # a GPU: times, prints TOPS, writes $OUT/int8_gemm.json
    PYTHONPATH=. python bench/int8_gemm.py --check-only   # no timing; on a CPU: tiny shapes, interpreter

Every path is checked against int8_matmul_reference first. Times are medians of CUDA-graph replays
(bench/kernel_times.py's graph_time_us) over enough weight copies that the L2 cannot hold them.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import start_kernel_sweep, write_json
from gemv import check_config

DTYPE = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TINY_SHAPES = {"ragged": (70, 352), "deep": (48, 1024)}
ROWS = (1, 16, 64, 256, 1024, 4096, 8192)
TINY_ROWS = (3, 20)


def make_int8(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from gpuworker.kernels.quant.int8_matmul import quantize_int8_rows_reference

    q, scale = quantize_int8_rows_reference(torch.randn(n, k) / k**0.5)
    return q.to(device), scale.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-only", action="store_true", help="check every path, no timing (CPU: tiny)")
    args = parser.parse_args()
    start = start_kernel_sweep("int8_gemm.py", args.check_only)
    device, timed = start.device, start.timed
    from gpuworker.kernels.quant.int8_matmul import int8_matmul, int8_matmul_reference, quantize_int8_rows

    on_cuda = device == "cuda"
    shapes, rows_list = (SHAPES, ROWS) if on_cuda else (TINY_SHAPES, TINY_ROWS)
    torch.manual_seed(0)
    if timed:
        from kernel_times import graph_time_us, num_sets
    results, failures = [], 0
    for name, (n, k) in shapes.items():
        copies = num_sets(n * k, cap=8) if timed else 1
        weights = [make_int8(n, k, device) for _ in range(copies)]
        dense = [(torch.randn(n, k, device=device) / k**0.5).to(DTYPE) for _ in range(copies)] if timed else []
        for m in rows_list:
            xs = [torch.randn(m, k, device=device).to(DTYPE) for _ in range(copies)]
            quantized = [quantize_int8_rows(x) for x in xs]
            expected = int8_matmul_reference(*quantized[0], *weights[0], out_dtype=DTYPE)
            paths = {
                "quantize+gemm": lambda i: int8_matmul(*quantize_int8_rows(xs[i]), *weights[i], out_dtype=DTYPE),
                "gemm": lambda i: int8_matmul(*quantized[i], *weights[i], out_dtype=DTYPE),
            }
            row = {"shape": name, "N": n, "K": k, "M": m, "us": {}}
            for label, call in paths.items():
                try:
                    err, ok = check_config(lambda: call(0), expected, repeats=1)
                    if not ok:
                        raise AssertionError(f"max abs err {err}")
                    if timed:
                        row["us"][label] = graph_time_us([lambda i=i: call(i) for i in range(copies)])
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    failures += 1
                    print(f"  {name} M={m} {label}: FAILED {repr(exc)[:200]}")
            if timed:
                row["us"]["cublas_bf16"] = graph_time_us([lambda i=i: F.linear(xs[i], dense[i]) for i in range(copies)])
                if m > 16 and m % 8 == 0:  # torch._int_mm's shape rules
                    row["us"]["cublas_int_mm"] = graph_time_us(
                        [lambda i=i: torch._int_mm(quantized[i][0], weights[i][0].t()) for i in range(copies)]
                    )
                tops = {label: 2 * m * n * k / us / 1e6 for label, us in row["us"].items()}
                print(
                    f"  {name} M={m}: "
                    + "  ".join(f"{label} {us:.1f} us ({tops[label]:.0f} TOPS)" for label, us in row["us"].items())
                )
            results.append(row)
        weights = dense = None
        if on_cuda:
            torch.cuda.empty_cache()
    write_json("int8_gemm" if timed else "int8_gemm_check", {"environment": start.env, "results": results})
    if failures:
        raise SystemExit(f"{failures} INT8 GEMM result(s) disagreed with the reference or failed to run")


if __name__ == "__main__":
    main()
