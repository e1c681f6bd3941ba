"""Perplexity of a model on the fixed evaluation text, scored by our own engine (LLMEngine.score_tokens).

The text is tokenized once and cut into consecutive windows of `window` tokens; each window is one
prefill, and every token in it but the first is scored given the tokens before it in the window.
The perplexity is exp of the mean negative log-likelihood over the scored tokens, summed in float64.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from gpuworker.contract.quality import PerplexityReport
from gpuworker.engine.llm_engine import LLMEngine

EVAL_TEXT = Path(__file__).with_name("eval_text.txt")
DEFAULT_WINDOW = 512


def eval_text() -> str:
    return EVAL_TEXT.read_text(encoding="utf-8")


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def windows(token_ids: list[int], window: int, max_tokens: int | None) -> list[list[int]]:
    """Consecutive windows of `window` tokens over the first max_tokens (None: all); a last window
    shorter than 2 tokens is dropped (nothing in it could be scored)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    ids = token_ids if max_tokens is None else token_ids[:max_tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids) - i >= 2]


def measure_perplexity(
    engine: LLMEngine, *, window: int = DEFAULT_WINDOW, max_tokens: int | None = None, text: str | None = None
) -> PerplexityReport:
    """The engine's model scored on `text` (default: the evaluation text)."""
    text = eval_text() if text is None else text
    if window > engine.config.max_model_len:
        raise ValueError(f"window {window} exceeds the engine's max_model_len {engine.config.max_model_len}")
    token_ids = engine.tokenizer.encode(text, add_special_tokens=False)
    total, scored = 0.0, 0
    for ids in windows(token_ids, window, max_tokens):
        logprobs = engine.score_tokens(ids)
        total -= float(logprobs.sum())
        scored += len(logprobs)
    if not scored:
        raise ValueError("the text is shorter than 2 tokens: nothing to score")
    quant = engine.model_config.quantization
    return PerplexityReport(
        perplexity=math.exp(total / scored),
        tokens=scored,
        window=window,
        text_sha256=text_sha256(text),
        quantization="" if quant is None else quant.label,
    )
