"""The fleet simulator's models of one replica's engine and of the traffic: a continuous-batching
replica whose speeds come from the engine's measured curves (BENCHMARKS.md), and a seeded synthetic
trace of multi-turn conversations. Standard library only; bench/fleet_sim.py runs them.

Figures used (Llama-3-8B shape, bf16, one H200; BENCHMARKS.md):
- decode step time by batch: 1 row 4.17 ms (240 tok/s, "Batch-1 decode", sixth session); decode-only
  steps of up to 64 / 65-128 / 129-256 / 257-384 / 385-512 rows 7.1 / 9.8 / 14.2 / 20.2 / 28.0 ms
  ("Where the wall time went", runs on 2463a85, warm cache), taken at each bucket's middle row count.
- prefill: 38,600 prompt tok/s (648e752: 587k prompt tokens in 15.2 s of mixed steps), chunked at
  8,192 tokens per step (max_num_batched_tokens of the 2026-11-30 throughput run); a mixed step
  takes the decode step's time plus the chunk's prefill time. Prompt tokens found in the replica's
  prefix cache cost nothing (the engine's hashed blocks are reused, not recomputed).
- KV pool 883,584 tokens (fifth session's run); 256 sequences at most (the engine's serving default).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

DECODE_STEP_S = ((1, 4.17e-3), (32, 7.1e-3), (96, 9.8e-3), (192, 14.2e-3), (320, 20.2e-3), (448, 28.0e-3))
PREFILL_TOK_S = 38_600.0
PREFILL_CHUNK_TOKENS = 8192
KV_CAPACITY_TOKENS = 883_584
MAX_NUM_SEQS = 256
CHARS_PER_TOKEN = 4  # to build the request bodies the router keys on

_ROWS = [rows for rows, _ in DECODE_STEP_S]


def decode_step_s(rows: int) -> float:
    """One decode step's time for `rows` sequences: linear between the measured points, and along
    the last segment's slope past them."""
    if rows <= 1:
        return DECODE_STEP_S[0][1]
    i = min(bisect.bisect_left(_ROWS, rows), len(_ROWS) - 1)
    (r0, t0), (r1, t1) = DECODE_STEP_S[i - 1], DECODE_STEP_S[i]
    return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)


_DECODE_STEP_TABLE = [decode_step_s(rows) for rows in range(MAX_NUM_SEQS + 1)]  # the hot path's lookup


# ---- traffic ----------------------------------------------------------------------------------


@dataclass(eq=False)  # identity: two requests are never equal
class Request:
    model: int
    conversation: Conversation
    turn: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cold: bool = False  # arrived while the model had no ready replica
    failed: bool = False
    first_token_at: float | None = None
    finished_at: float | None = None
    replica_id: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def body(self) -> dict:
        """The OpenAI-style chat request this turn sends (the router keys on it as the gateway does):
        the model's system prompt, then the conversation so far, CHARS_PER_TOKEN characters a token."""
        return {"model": f"model-{self.model}", "messages": self.conversation.messages(self.turn)}


@dataclass(eq=False)
class Conversation:
    id: int
    model: int
    system: str  # the model's system prompt
    user_tokens: list[int]  # per turn
    output_tokens: list[int]  # per turn
    think_s: list[float]  # before each turn after the first
    system_tokens: int
    history: int = 0  # tokens sent and received so far

    def messages(self, turn: int) -> list[dict]:
        """The messages of the request for `turn`: built when asked, not kept (a run has many)."""
        messages = [{"role": "system", "content": self.system}]
        for k in range(turn + 1):
            messages.append({"role": "user", "content": self._text("user", k, self.user_tokens[k])})
            if k < turn:
                messages.append({"role": "assistant", "content": self._text("assistant", k, self.output_tokens[k])})
        return messages

    def _text(self, role: str, turn: int, tokens: int) -> str:
        chars = tokens * CHARS_PER_TOKEN
        words = f"{role} turn {turn} of conversation {self.id}. "
        return (words * (chars // len(words) + 1))[:chars]

    def request(self, turn: int, now: float) -> Request:
        prompt = (self.system_tokens if turn == 0 else self.history) + self.user_tokens[turn]
        return Request(self.model, self, turn, now, prompt, self.output_tokens[turn])


@dataclass(frozen=True)
class TraceShape:
    models: int = 20
    zipf_s: float = 1.1
    peak_requests_per_s: float = 40.0  # all models, at the top of the daily cycle, outside bursts
    trough_fraction: float = 0.25  # the night's rate as a fraction of the peak
    day_s: float = 4 * 3600.0  # one daily cycle (compressed: 24 h of shape in this many seconds)
    bursts: int = 4  # per day, at seeded times, each multiplying all traffic
    burst_factor: float = 5.0
    burst_s: float = 120.0
    mean_turns: float = 4.0
    think_mean_s: float = 20.0
    system_prompt_chars: int = 240  # the length of each model's system prompt
    first_message_tokens: int = 300  # median (lognormal)
    message_tokens: int = 80  # median of later user messages
    output_tokens: int = 200  # median (lognormal), capped at 1024


class Trace:
    """Conversation starts per model as a non-homogeneous Poisson process (thinning), each model
    with its own seeded stream, so every scenario replays the same conversations."""

    def __init__(self, shape: TraceShape, seed: int, duration_s: float):
        self.shape, self.duration_s = shape, duration_s
        weights = [1 / (i + 1) ** shape.zipf_s for i in range(shape.models)]
        total = sum(weights)
        self.share = [w / total for w in weights]
        layout = random.Random(seed)
        days = max(1, math.ceil(duration_s / shape.day_s))
        self.burst_starts = sorted(
            layout.uniform(d * shape.day_s, (d + 1) * shape.day_s - shape.burst_s)
            for d in range(days)
            for _ in range(shape.bursts)
        )
        self._rngs = [random.Random(f"{seed}:{m}") for m in range(shape.models)]
        self._next_id = [m * 10_000_000 for m in range(shape.models)]
        self._system_text = [
            (f"You are assistant {m} of the fleet simulator. " * (shape.system_prompt_chars // 40 + 1))[
                : shape.system_prompt_chars
            ]
            for m in range(shape.models)
        ]

    def rate(self, t: float) -> float:
        """All models' request rate at time t (requests per second)."""
        s = self.shape
        day = 0.5 - 0.5 * math.cos(2 * math.pi * (t % s.day_s) / s.day_s)  # 0 at midnight, 1 at noon
        base = s.peak_requests_per_s * (s.trough_fraction + (1 - s.trough_fraction) * day)
        i = bisect.bisect_right(self.burst_starts, t) - 1
        if i >= 0 and t < self.burst_starts[i] + s.burst_s:
            base *= s.burst_factor
        return base

    def next_conversation(self, model: int, after: float) -> tuple[float, Conversation] | None:
        """The model's next conversation start after `after`, or None past the end."""
        s, rng = self.shape, self._rngs[model]
        scale = self.share[model] / s.mean_turns
        t = after
        while True:  # thinning under a bound that is the burst's inside a burst and the peak outside
            i = bisect.bisect_right(self.burst_starts, t) - 1
            in_burst = i >= 0 and t < self.burst_starts[i] + s.burst_s
            bound = s.peak_requests_per_s * (s.burst_factor if in_burst else 1.0) * scale
            change = (
                self.burst_starts[i] + s.burst_s
                if in_burst
                else (self.burst_starts[i + 1] if i + 1 < len(self.burst_starts) else math.inf)
            )
            candidate = t + rng.expovariate(bound)
            if candidate >= change:  # the bound changes first: start again there (memoryless)
                t = change
                continue
            t = candidate
            if t >= self.duration_s:
                return None
            if rng.random() * bound <= self.rate(t) * scale:
                break
        turns = min(12, 1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / s.mean_turns)))
        users = [_lognormal(rng, s.first_message_tokens if k == 0 else s.message_tokens, 4096) for k in range(turns)]
        outputs = [_lognormal(rng, s.output_tokens, 1024) for _ in range(turns)]
        think = [rng.expovariate(1 / s.think_mean_s) for _ in range(turns)]
        cid = self._next_id[model]
        self._next_id[model] += 1
        return t, Conversation(
            cid, model, self._system_text[model], users, outputs, think, s.system_prompt_chars // CHARS_PER_TOKEN
        )


def _lognormal(rng: random.Random, median: float, cap: int) -> int:
    return max(1, min(cap, int(rng.lognormvariate(math.log(median), 0.8))))


# ---- one replica ------------------------------------------------------------------------------


@dataclass(eq=False)
class Replica:
    """One replica's engine as a fluid model between events: prefill runs first-come first-served
    at the chunked-prefill rate, every running sequence decodes one token per step, and a step
    takes the decode time for the batch plus the prefill chunk's time."""

    replica_id: int
    model: int
    created_at: float
    ready_at: float
    state: str = "loading"  # loading | ready | draining | released
    released_at: float | None = None
    waiting: deque = field(default_factory=deque)  # admitted by the router, not yet running
    prefilling: deque = field(default_factory=deque)  # [request, uncached tokens left]
    decoding: list = field(default_factory=list)  # heap of (progress at which it ends, n, request)
    progress: float = 0.0  # decode steps every running sequence has had so far
    updated_at: float = 0.0
    kv_used: int = 0
    prefix_cache: OrderedDict = field(default_factory=OrderedDict)  # conversation (-1: system) -> tokens
    cached_tokens: int = 0
    version: int = 0  # the events scheduled for an older version are stale
    ttft_samples: deque = field(default_factory=deque)  # (time, seconds)
    step_samples: deque = field(default_factory=deque)  # (time, seconds)
    _n: int = 0

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def step_s(self) -> tuple[float, float]:
        """(step time, prefill tokens per step) in the current state."""
        chunk = 0.0
        for _, left in self.prefilling:
            chunk += left
            if chunk >= PREFILL_CHUNK_TOKENS:
                chunk = PREFILL_CHUNK_TOKENS
                break
        rows = len(self.decoding)
        decode = _DECODE_STEP_TABLE[rows] if rows <= MAX_NUM_SEQS else decode_step_s(rows)
        return decode + chunk / PREFILL_TOK_S, chunk

    def advance(self, now: float) -> None:
        dt = now - self.updated_at
        self.updated_at = now
        if dt <= 0:
            return
        step, chunk = self.step_s()
        if self.decoding:
            self.progress += dt / step
        if self.prefilling:
            self.prefilling[0][1] -= dt * chunk / step

    def next_event_at(self, now: float) -> tuple[float | None, float]:
        """(when the next prefill or sequence ends, or None; the current step time)."""
        step, chunk = self.step_s()
        at = None
        if self.prefilling:
            at = now + max(0.0, self.prefilling[0][1]) * step / chunk if chunk > 0 else now
        if self.decoding:
            done = now + max(0.0, self.decoding[0][0] - self.progress) * step
            at = done if at is None or done < at else at
        return at, step

    def admit(self) -> None:
        """Moves waiting requests into the batch while sequences and KV blocks allow."""
        while self.waiting and self.running < MAX_NUM_SEQS:
            request = self.waiting[0]
            need = request.prompt_tokens + request.output_tokens
            if self.kv_used + need > KV_CAPACITY_TOKENS and self.running:
                break
            self.waiting.popleft()
            self.kv_used += need
            hit = self._cached(request)
            self.prefilling.append([request, max(1, request.prompt_tokens - hit)])
            self._evict()

    def _cached(self, request: Request) -> int:
        for key in (request.conversation.id, -1):
            tokens = self.prefix_cache.get(key)
            if tokens is not None:
                self.prefix_cache.move_to_end(key)
                return min(tokens, request.prompt_tokens)
        return 0

    def remember(self, key: int, tokens: int) -> None:
        self.cached_tokens += tokens - self.prefix_cache.pop(key, 0)
        self.prefix_cache[key] = tokens
        self._evict()

    def _evict(self) -> None:
        while self.prefix_cache and self.cached_tokens > KV_CAPACITY_TOKENS - self.kv_used:
            _, tokens = self.prefix_cache.popitem(last=False)
            self.cached_tokens -= tokens

    def start_decoding(self, request: Request) -> None:
        self._n += 1
        heapq.heappush(self.decoding, (self.progress + request.output_tokens - 1, self._n, request))

    def release(self, request: Request) -> None:
        self.kv_used -= request.prompt_tokens + request.output_tokens
        self.remember(request.conversation.id, request.prompt_tokens + request.output_tokens)

    def sample(self, samples: deque, now: float, value: float, window_s: float) -> None:
        samples.append((now, value))
        while samples and samples[0][0] < now - window_s:
            samples.popleft()

    def p95(self, samples: deque, now: float, window_s: float) -> float | None:
        while samples and samples[0][0] < now - window_s:
            samples.popleft()
        if not samples:
            return None
        values = sorted(v for _, v in samples)
        return values[min(len(values) - 1, int(0.95 * len(values)))]
