"""Measure a model's perplexity on the evaluation text and print the report as one JSON line.

    python -m gpuworker.quality /models/llama-3-8b [--quantization fp8] [--window 512] [--max-tokens N]

The control plane records it: python manage.py record_perplexity MODEL_NAME --report report.json
"""

from __future__ import annotations

import argparse
import json
import sys

from gpuworker.checkpoint_quantization import LOAD_QUANTIZATIONS
from gpuworker.engine.llm_engine import LLMEngine
from gpuworker.quality.perplexity import DEFAULT_WINDOW, measure_perplexity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuworker.quality", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory or GGUF file")
    parser.add_argument("--quantization", choices=[q for q in LOAD_QUANTIZATIONS if q], default=None)
    parser.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per scored window")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    args = parser.parse_args(argv)
    try:
        engine = LLMEngine(
            args.model,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            max_model_len=args.window,
        )
        report = measure_perplexity(engine, window=args.window, max_tokens=args.max_tokens)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json()))
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
