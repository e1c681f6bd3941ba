"""SamplingParams: how one request is decoded, with vLLM's names and OpenAI's semantics.

Validated on construction: a bad value raises ValueError naming the field and its limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from gpuworker.engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20
# OpenAI's bounds on logit_bias: a bias per token in [-100, 100], for at most this many tokens.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
# A tenant's weight is relative; past this a weight is a typo, not a share.
MAX_TENANT_WEIGHT = 1000.0
# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
GREEDY_TEMPERATURE = 1e-5
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# A request's priority class, in the order the fair scheduler admits them (engine.fair_share): the
# batch API's work and keys marked batch are "batch", and give way to "interactive".
PRIORITIES = ("interactive", "batch")


@dataclass
class SamplingParams:
    n: int = 1
    # 0 means greedy: exactly the argmax of the (penalised) logits.
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 or 0: no top-k filter.
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Same seed, same output, whatever else shares the batch.
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: as many tokens as fit in the engine's max_model_len.
    max_tokens: int | None = None
    # EOS and stop token ids are ignored until this many tokens are out.
    min_tokens: int = 0
    # None: no logprobs; k >= 0: the chosen token's logprob plus the k most likely tokens'.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # "cumulative": step() returns the request's output whenever it has new tokens (vLLM's
    # default, what streaming reads); "final_only": only once it finishes, which spares building
    # an output object per request per step (offline batches, LLMEngine.generate); "delta": as
    # cumulative, but text, token_ids and logprobs hold only what the step added (vLLM's DELTA), so
    # a step copies nothing of a long stream (the engine process: its API side accumulates).
    output_kind: str = "cumulative"
    # Constrain the output to JSON, a JSON schema, a grammar or a structural tag (None: free text).
    structured_output: StructuredOutput | None = None
    # token id -> a bias added to its logit before sampling (OpenAI's logit_bias): +100 all but
    # forces a token, -100 all but bans it. Logprobs stay those of the raw logits, as vLLM's.
    logit_bias: dict[int, float] | None = None
    # Who the request is served for, and how (engine.fair_share). They ride here, with the other
    # per-request fields, so that they reach the engine's process with the request. None: the
    # default tenant that every request without one shares.
    tenant: str | None = None
    # The tenant's share relative to others' (its plan's): weight 2 is served twice as much as 1.
    tenant_weight: float = 1.0
    priority: str = "interactive"

    def __post_init__(self) -> None:
        _int_at_least("n", self.n, 1)
        _number_in("temperature", self.temperature, low=0.0)
        _number_in("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        _number_in("min_p", self.min_p, low=0.0, high=1.0)
        _number_in("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _number_in("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _number_in("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        if self.seed is not None:
            _int("seed", self.seed)
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must hold non-empty strings, got {text!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for token_id in self.stop_token_ids:
            _int_at_least("stop_token_ids", token_id, 0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.tenant is not None and (not isinstance(self.tenant, str) or not self.tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {self.tenant!r}")
        _number_in("tenant_weight", self.tenant_weight, low=0.0, high=MAX_TENANT_WEIGHT, low_open=True)
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(
                f"structured_output must be a StructuredOutput or None, got {type(self.structured_output).__name__}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids int64, biases float32), made once: the sampler reads them
        every step the request samples."""
        bias = self.logit_bias or {}
        return (np.fromiter(bias.keys(), np.int64, len(bias)), np.fromiter(bias.values(), np.float32, len(bias)))


def _logit_bias(bias: object) -> dict[int, float] | None:
    """The bias map checked (ids >= 0, biases in range, not too many), floats; None when empty.
    Whether the ids are in the model's vocabulary is the engine's check (it knows the model)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    checked = {}
    for token_id, value in bias.items():
        _int_at_least("logit_bias token id", token_id, 0)
        _number_in(f"logit_bias[{token_id}]", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        checked[token_id] = float(value)
    return checked or None


def _int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _int_at_least(name: str, value: object, low: int) -> None:
    _int(name, value)
    if value < low:  # type: ignore[operator]
        raise ValueError(f"{name} must be at least {low}, got {value}")


def _number_in(
    name: str, value: object, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"greater than {low}" if low_open else f"at least {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value}")
