"""Batched sampling on the device, one row per sequence that needs a token this step.

Penalties (OpenAI/vLLM semantics) -> grammar masks (constrained rows only) -> temperature -> top-k
-> top-p -> min-p, then a draw by the exponential-noise trick: argmax(probs / E) with E ~ Exp(1)
samples from probs without a cumulative sum or a multinomial, and without any device->host sync. Seeded rows draw their noise from a
generator keyed by (seed, choice index, output position), so a seeded request gets the same tokens
whatever else shares the batch and however it was scheduled. Temperature 0 is the plain argmax.
Logprobs are those of the model's raw logits (before penalties and temperature), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.sequence import Sequence
from gpuworker.engine.grammar_masks import TokenBitmask

_SEED_MASK = (1 << 63) - 1


@dataclass
class SamplingMetadata:
    # [B] float32; 1.0 on greedy rows, whose draws are replaced by the argmax anyway.
    # None (like `greedy`) when every row is greedy: nothing is drawn.
    temperature: torch.Tensor | None
    greedy: torch.Tensor | None  # [B] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [B] float32, > 1 where disabled
    min_p: torch.Tensor | None  # [B] float32
    penalties: Penalties | None
    # (rows, token ids) whose logits are -inf: EOS and stop tokens before min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    # (row, generator seed) for the rows of seeded requests.
    seeded_rows: list[tuple[int, int]]
    # The most top logprobs any row asked for; None when no row wants logprobs.
    max_logprobs: int | None

    @property
    def plain_argmax(self) -> bool:
        """Every row takes the argmax of its raw logits: no penalties, bans or logprobs."""
        return self.all_greedy and self.penalties is None and self.banned is None and self.max_logprobs is None

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int],
              device: torch.device) -> SamplingMetadata:
        if all(seq.group.plain_greedy for seq in seqs):
            # The common offline case, kept cheap: argmax of the raw logits, nothing to copy.
            return cls(temperature=None, greedy=None, all_greedy=True, top_k=None, top_p=None, min_p=None,
                       penalties=None, banned=None, seeded_rows=[], max_logprobs=None)
        params: list[SamplingParams] = [seq.group.params for seq in seqs]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        greedy = [p.is_greedy for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        banned_rows, banned_ids = [], []
        for row, (seq, p) in enumerate(zip(seqs, params)):
            # A grammar decides itself where a constrained output may end.
            if seq.num_output_tokens < p.min_tokens and p.structured_output is None:
                ids = [*([] if p.ignore_eos else eos_token_ids), *p.stop_token_ids]
                banned_rows += [row] * len(ids)
                banned_ids += ids
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32),
            greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=tensor(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
            top_p=tensor(top_p, torch.float32) if any(p <= 1.0 for p in top_p) else None,
            min_p=tensor([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None,
            penalties=Penalties.build(seqs, vocab_size, device) if any(p.has_penalties for p in params) else None,
            banned=(tensor(banned_rows, torch.int64), tensor(banned_ids, torch.int64)) if banned_rows else None,
            seeded_rows=[(row, noise_seed(p.seed, seq.index, seq.num_output_tokens))
                         for row, (seq, p) in enumerate(zip(seqs, params)) if p.seed is not None],
            max_logprobs=max(wanted) if wanted else None,
        )


@dataclass
class Penalties:
    presence: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]
    output_counts: torch.Tensor  # [B, V] how often each token was generated
    seen: torch.Tensor  # [B, V] bool: in the prompt or the output

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> Penalties:
        params = [seq.group.params for seq in seqs]
        outputs = _padded([seq.output_token_ids for seq in seqs], vocab_size, device)
        prompts = _padded([seq.group.prompt_token_ids for seq in seqs], vocab_size, device)
        # One extra column takes the padding, then is dropped.
        counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.int32, device=device)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.int32))
        seen = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompts, True)
        output_counts = counts[:, :vocab_size]
        return cls(
            presence=to_device([p.presence_penalty for p in params], torch.float32, device),
            frequency=to_device([p.frequency_penalty for p in params], torch.float32, device),
            repetition=to_device([p.repetition_penalty for p in params], torch.float32, device),
            output_counts=output_counts,
            seen=seen[:, :vocab_size] | (output_counts > 0),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        repetition = self.repetition[:, None]
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(self.seen, penalised, logits)
        counts = self.output_counts.to(logits.dtype)
        return (logits - self.frequency[:, None] * counts
                - self.presence[:, None] * (counts > 0).to(logits.dtype))


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # Only when some row asked for logprobs: the chosen token's [B], the top ids/values [B, k].
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # For unseeded rows; seeded once so that a whole engine run is reproducible.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 allowed: TokenBitmask | None = None) -> SamplerOutput:
        """logits [B, V] float32 -> one token per row; `allowed` masks the constrained rows."""
        raw = logits
        if meta.penalties is not None:
            logits = meta.penalties.apply(logits)
        if meta.banned is not None:
            logits = logits.index_put(meta.banned, torch.tensor(float("-inf"), device=logits.device))
        if allowed is not None:
            if logits is raw and meta.max_logprobs is not None:
                logits = logits.clone()  # logprobs are those of the raw logits
            apply_token_bitmask(logits, allowed)
        greedy_ids = logits.argmax(dim=-1)
        if meta.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = torch.where(meta.greedy, greedy_ids, self._draw(logits, meta))
        out = SamplerOutput(token_ids=token_ids)
        if meta.max_logprobs is not None:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
            out.top_logprobs, out.top_ids = logprobs.topk(meta.max_logprobs, dim=-1)
        return out

    def _draw(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits / meta.temperature[:, None]
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            threshold = meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in meta.seeded_rows:
            generator = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row].exponential_(generator=generator)
        # Filtered tokens have probability 0 and so can never win; the clamp keeps 0/0 out.
        return (probs / noise.clamp_min(1e-20)).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top k, then outside the smallest set of most
    likely tokens whose probability reaches top_p (the most likely token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_token_bitmask(logits: torch.Tensor, allowed: TokenBitmask) -> None:
    """Set to -inf, in place, the logits of the tokens a grammar forbids in the constrained rows
    (xgrammar's kernel: Triton on CUDA, C++ on CPU); the host bitmask is copied without blocking."""
    import xgrammar as xgr

    device = logits.device
    if device.type == "cpu":
        bitmask, rows = allowed.bitmask, allowed.rows
    else:
        bitmask = allowed.bitmask.to(device, non_blocking=True)
        rows = to_device(allowed.rows, torch.int32, device)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def noise_seed(seed: int, index: int, position: int) -> int:
    """The noise generator's seed for choice `index` of a seeded request at output `position`."""
    return hash((seed, index, position)) & _SEED_MASK


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or numpy array as a device tensor, copied asynchronously (from pinned memory on
    CUDA)."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.asarray(values, dtype=np_dtype))
    elif np_dtype is None or (values and isinstance(values[0], list)):
        host = torch.tensor(values, dtype=dtype)
    else:  # numpy converts a flat list of numbers faster (BENCHMARKS.md, "Figures formerly in code comments")
        host = torch.from_numpy(np.array(values, dtype=np_dtype))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(row) for row in rows))
    return to_device([row + [pad] * (width - len(row)) for row in rows], torch.int64, device)
