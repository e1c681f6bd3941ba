"""Batched sampling on the device, one row per sequence that needs a token this step.

Logit bias -> penalties (OpenAI/vLLM semantics) -> grammar masks (constrained rows only) -> temperature -> top-k
-> top-p -> min-p, then a Gumbel-max draw (gpuworker.kernels.sampling.sample: one Triton launch on CUDA,
no sort of the vocabulary and no device->host sync; the same draws by a full sort in torch on the
CPU). Every row's noise comes from Philox keyed by a per-row seed: a seeded request's key is made
from (seed, choice index, output position), so it gets the same tokens whatever else shares the
batch and however it was scheduled; the others' keys come from the sampler's generator, seeded
once per engine. Temperature 0 is the plain argmax. Logprobs are those of the model's raw logits
(before penalties and temperature), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from gpuworker.engine.grammar_masks import TokenBitmask
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.sequence import Sequence

_SEED_MASK = (1 << 63) - 1


@dataclass
class SamplingMetadata:
    # [B] float32, 0.0 on greedy rows. None (like the filters) when every row is greedy.
    temperature: torch.Tensor | None
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled; None when no row filters
    top_p: torch.Tensor | None  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor | None  # [B] float32
    # [B] int64: each row's noise key (see the module docstring).
    seeds: torch.Tensor | None
    penalties: Penalties | None
    # (rows, token ids) whose logits are -inf: EOS and stop tokens before min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    # The requests' logit_bias entries as (flat indices row * V + token, biases); None when no row has any.
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None
    # The most top logprobs any row asked for; None when no row wants logprobs.
    max_logprobs: int | None

    @property
    def plain_argmax(self) -> bool:
        """Every row takes the argmax of its raw logits: no bias, penalties, bans or logprobs."""
        return (
            self.all_greedy
            and self.penalties is None
            and self.banned is None
            and self.logit_bias is None
            and self.max_logprobs is None
        )

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        rng: np.random.Generator,
    ) -> SamplingMetadata:
        """`rng` draws the noise keys of unseeded rows."""
        if all(seq.group.plain_greedy for seq in seqs):
            # The common offline case, kept cheap: argmax of the raw logits, nothing to copy.
            return cls(
                temperature=None,
                all_greedy=True,
                top_k=None,
                top_p=None,
                min_p=None,
                seeds=None,
                penalties=None,
                banned=None,
                logit_bias=None,
                max_logprobs=None,
            )
        params: list[SamplingParams] = [seq.group.params for seq in seqs]
        banned_rows, banned_ids = [], []
        for row, (seq, p) in enumerate(zip(seqs, params)):
            # A grammar decides itself where a constrained output may end.
            if seq.num_output_tokens < p.min_tokens and p.structured_output is None:
                ids = [*([] if p.ignore_eos else eos_token_ids), *p.stop_token_ids]
                banned_rows += [row] * len(ids)
                banned_ids += ids
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        banned = (
            (to_device(banned_rows, torch.int64, device), to_device(banned_ids, torch.int64, device))
            if banned_rows
            else None
        )
        penalties = Penalties.build(seqs, vocab_size, device) if any(p.has_penalties for p in params) else None
        logit_bias = _logit_bias(params, vocab_size, device) if any(p.logit_bias for p in params) else None
        max_logprobs = max(wanted) if wanted else None
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return cls(
                temperature=None,
                all_greedy=True,
                top_k=None,
                top_p=None,
                min_p=None,
                seeds=None,
                penalties=penalties,
                banned=banned,
                logit_bias=logit_bias,
                max_logprobs=max_logprobs,
            )
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        seeds = rng.integers(0, _SEED_MASK, size=len(seqs), dtype=np.int64)
        for row, (seq, p) in enumerate(zip(seqs, params)):
            if p.seed is not None:
                seeds[row] = noise_seed(p.seed, seq.index, seq.num_output_tokens)
        # Two host->device copies: the float parameters and the integer ones.
        floats = to_device(
            np.array(
                [
                    [0.0 if g else p.temperature for g, p in zip(greedy, params)],
                    [p.top_p for p in params],
                    [p.min_p for p in params],
                ],
                dtype=np.float32,
            ),
            torch.float32,
            device,
        )
        ints = to_device(np.stack([np.array(top_k, dtype=np.int64), seeds]), torch.int64, device)
        return cls(
            temperature=floats[0],
            all_greedy=False,
            top_k=ints[0] if any(k < vocab_size for k in top_k) else None,
            top_p=floats[1] if any(p.top_p < 1.0 for p in params) else None,
            min_p=floats[2] if any(p.min_p > 0 for p in params) else None,
            seeds=ints[1],
            penalties=penalties,
            banned=banned,
            logit_bias=logit_bias,
            max_logprobs=max_logprobs,
        )


@dataclass
class Penalties:
    """Repetition, presence and frequency penalties, applied only where they apply: to the logits of
    the tokens each row has seen, gathered, penalised and scattered back in a few vectorised ops."""

    presence: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]
    # Flat indices row * V + token: every prompt token then every output token (repeats included).
    seen: torch.Tensor
    num_prompt_entries: int
    vocab_size: int

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> Penalties:
        params = [seq.group.params for seq in seqs]
        prompts = [seq.group.prompt_token_ids for seq in seqs]
        outputs = [seq.output_token_ids for seq in seqs]
        row_starts = np.arange(len(seqs), dtype=np.int64) * vocab_size

        def entries(rows: list[list[int]]) -> np.ndarray:
            tokens = np.fromiter(chain.from_iterable(rows), np.int64)
            flat = tokens + np.repeat(row_starts, [len(r) for r in rows])
            return flat[tokens < vocab_size]  # ids past the model's vocabulary have no logit

        prompt_entries, output_entries = entries(prompts), entries(outputs)
        factors = to_device(
            np.array(
                [
                    [p.presence_penalty for p in params],
                    [p.frequency_penalty for p in params],
                    [p.repetition_penalty for p in params],
                ],
                dtype=np.float32,
            ),
            torch.float32,
            device,
        )
        return cls(
            presence=factors[0],
            frequency=factors[1],
            repetition=factors[2],
            seen=to_device(np.concatenate([prompt_entries, output_entries]), torch.int64, device),
            num_prompt_entries=len(prompt_entries),
            vocab_size=vocab_size,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalise `logits` [B, V] in place (and return it)."""
        flat = logits.view(-1)
        outputs = self.seen[self.num_prompt_entries :]
        counts = torch.zeros(flat.shape, dtype=torch.int32, device=flat.device)
        counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))
        rows = self.seen // self.vocab_size
        count = counts[self.seen].to(flat.dtype)
        values = flat[self.seen]
        repetition = self.repetition[rows]
        values = torch.where(values > 0, values / repetition, values * repetition)
        # A token seen several times is written several times, always with the same value.
        flat[self.seen] = values - self.frequency[rows] * count - self.presence[rows] * (count > 0).to(flat.dtype)
        return logits


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
        # Noise keys for unseeded rows; seeded once so that a whole engine run is reproducible.
        self.rng = np.random.default_rng(seed)

    def metadata(self, seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int]) -> SamplingMetadata:
        return SamplingMetadata.build(seqs, vocab_size, eos_token_ids, self.device, self.rng)

    @torch.no_grad()
    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, allowed: TokenBitmask | None = None
    ) -> SamplerOutput:
        """logits [B, V] float32 -> one token per row; `allowed` masks the constrained rows."""
        raw = logits
        if meta.max_logprobs is not None and (
            meta.penalties is not None or meta.logit_bias is not None or allowed is not None
        ):
            logits = logits.clone()  # logprobs are those of the raw logits
        if meta.logit_bias is not None:
            # A sparse add, in place: only the biased tokens' logits are touched.
            logits.view(-1).index_add_(0, *meta.logit_bias)
        if meta.penalties is not None:
            logits = meta.penalties.apply(logits)
        if meta.banned is not None:
            logits = logits.index_put(meta.banned, torch.tensor(float("-inf"), device=logits.device))
        if allowed is not None:
            apply_token_bitmask(logits, allowed)
        if meta.all_greedy:
            token_ids = logits.argmax(dim=-1)
        elif logits.is_cuda:
            from gpuworker.kernels.sampling.sample import sample  # Triton only where there is a GPU

            token_ids = sample(
                logits, meta.temperature, seeds=meta.seeds, top_k=meta.top_k, top_p=meta.top_p, min_p=meta.min_p
            )
        else:
            from gpuworker.kernels.sampling.sample import sample_reference

            token_ids, _ = sample_reference(
                logits, meta.temperature, seeds=meta.seeds, top_k=meta.top_k, top_p=meta.top_p, min_p=meta.min_p
            )
        out = SamplerOutput(token_ids=token_ids)
        if meta.max_logprobs is not None:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
            out.top_logprobs, out.top_ids = logprobs.topk(meta.max_logprobs, dim=-1)
        return out


def _logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's logit_bias entries as flat indices into the [B, V] logits and their biases."""
    ids, values = zip(*(p.logit_bias_arrays for p in params))
    rows = np.repeat(np.arange(len(params), dtype=np.int64) * vocab_size, [len(i) for i in ids])
    return (
        to_device(np.concatenate(ids) + rows, torch.int64, device),
        to_device(np.concatenate(values), torch.float32, device),
    )


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
