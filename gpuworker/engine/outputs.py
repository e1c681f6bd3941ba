"""What the engine hands back: per-request outputs (vLLM's shape) and per-step statistics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely tokens at this position, most likely first: (token id, logprob).
    top_logprobs: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    index: int
    # Everything generated so far (released text only: text that might still turn out to be the
    # start of a stop string is held back until that is known).
    text: str
    token_ids: list[int]
    # None while running; "stop", "length" or "abort" once finished.
    finish_reason: str | None
    # The stop string or stop token id that ended it, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    # What this step added, for streaming.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    # GPU time attributed to this request: each step's wall time (from its scheduling to its tokens
    # checked) divided among the sequences it processed, in proportion to their tokens. Summed over
    # requests it is the engine's busy time (LLMEngine.busy_time_s); a sequence scheduled ahead
    # (async scheduling) in a step after its request finished can leave that share unreported.
    gpu_time_s: float
    num_preemptions: int
    # When a step first ran the request (None if it never ran): queue time = this - arrival_time.
    first_scheduled_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int
    metrics: RequestMetrics

    # Conveniences for the common n == 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.outputs)


def merge_outputs(older: RequestOutput, newer: RequestOutput, *, deltas: bool = False) -> RequestOutput:
    """One output standing for two consecutive outputs of a request, for a consumer that fell
    behind: the newer state, with each completion's deltas of both joined in order (and, for
    output_kind="delta" outputs, whose text, token ids and logprobs are deltas too, those)."""
    if deltas:
        return join_deltas([older, newer])
    earlier = {c.index: c for c in older.outputs}
    outputs = []
    for c in newer.outputs:
        before = earlier.get(c.index)
        if before is not None:
            c = dataclasses.replace(
                c,
                delta_text=before.delta_text + c.delta_text,
                delta_token_ids=before.delta_token_ids + c.delta_token_ids,
            )
        outputs.append(c)
    return dataclasses.replace(newer, outputs=outputs)


def join_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive output_kind="delta" outputs of a request as one: the newest state, with each
    completion's text, token ids and logprobs joined in order, once (linear in their length, where
    joining them step by step, as a cumulative output does, copies the answer so far every step)."""
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    for output in outputs:
        for c in output.outputs:
            texts.setdefault(c.index, []).append(c.text)
            token_ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                logprobs.setdefault(c.index, []).extend(c.logprobs)
    joined = []
    for c in outputs[-1].outputs:
        text, ids = "".join(texts[c.index]), token_ids[c.index]
        joined.append(
            dataclasses.replace(
                c,
                text=text,
                token_ids=ids,
                delta_text=text,
                delta_token_ids=list(ids),
                logprobs=logprobs.get(c.index, []) if c.logprobs is not None else None,
            )
        )
    return dataclasses.replace(outputs[-1], outputs=joined)


@dataclass
class StepStats:
    """One engine step, for metrics."""

    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    # request id -> tokens run through the model for it this step.
    tokens_per_request: dict[str, int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by live sequences
    # Cumulative counters since start-up (tokens for the prefix cache).
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_generated_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens
