"""The engine's side of constrained decoding: one xgrammar matcher per constrained sequence (each
of n choices its own), advanced with every sampled token, and the token bitmask of every constrained
row of a step built in one multi-threaded call into a pinned int32 buffer. The engine builds that
mask while the step's forward pass runs on the device (the forward does not need it, only sampling
does), so with async scheduling a constrained request keeps the GPU as busy as an unconstrained one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuworker.engine.structured_output import GrammarCache, StructuredOutput

if TYPE_CHECKING:
    import torch
    import xgrammar

    from gpuworker.engine.sequence import Sequence, SequenceGroup

logger = logging.getLogger(__name__)


@dataclass
class TokenBitmask:
    """The allowed tokens of a step's constrained rows: bits of `bitmask` rows `rows`."""

    bitmask: torch.Tensor  # [num sampling rows, ceil(vocab / 32)] int32 on the host (pinned on CUDA)
    rows: list[int]  # the constrained rows; the other rows of `bitmask` are not filled


class GrammarMatchers:
    """The engine's grammar matchers: one per constrained sequence, keyed by seq_id.

    A matcher has accepted exactly the sequence's known output tokens: a preempted sequence keeps
    its tokens (it is recomputed, not regenerated), so its matcher needs no rewinding.
    """

    def __init__(self, grammars: GrammarCache, pin_memory: bool) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.grammars = grammars
        self.pin_memory = pin_memory
        self._matchers: dict[int, xgrammar.GrammarMatcher] = {}
        self._batch = xgr.BatchGrammarMatcher()

    def compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        return self.grammars.get(structured)

    def add(self, group: SequenceGroup, compiled: xgrammar.CompiledGrammar) -> None:
        for seq in group.seqs:
            self._matchers[seq.seq_id] = self._xgr.GrammarMatcher(compiled)

    def remove(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._matchers.pop(seq.seq_id, None)

    def any_constrained(self, seqs: list[Sequence]) -> bool:
        matchers = self._matchers
        return bool(matchers) and any(seq.seq_id in matchers for seq in seqs)

    def accept(self, seq: Sequence, token_id: int) -> bool:
        """Advance seq's matcher by its new token; True when the grammar has now terminated (it
        accepted a stop token) or can never continue. A token the mask did not allow is refused by
        xgrammar and ends the sequence too, logged, instead of failing the step."""
        matcher = self._matchers[seq.seq_id]
        if not matcher.accept_token(token_id):
            logger.error("%s: token %d is outside its grammar; ending the sequence", seq, token_id)
            return True
        return matcher.is_terminated()

    def bitmask(self, seqs: list[Sequence]) -> TokenBitmask | None:
        """The mask of every row of seqs (a step's sampling rows) whose sequence is constrained and
        still running, or None when there is none."""
        rows, matchers = [], []
        for row, seq in enumerate(seqs):
            matcher = self._matchers.get(seq.seq_id)
            # A sequence finished by the previous step still has a row here; its token is dropped.
            if matcher is not None and not seq.is_finished and not matcher.is_terminated():
                rows.append(row)
                matchers.append(matcher)
        if not rows:
            return None
        import torch

        width = (self.grammars.vocab_size + 31) // 32
        bitmask = torch.empty((len(seqs), width), dtype=torch.int32, pin_memory=self.pin_memory)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        return TokenBitmask(bitmask, rows)

    def __len__(self) -> int:
        return len(self._matchers)
