"""Requests and their sequences as the scheduler and block manager see them (no torch here).

A request (`SequenceGroup`) holds `n` sequences that share the prompt. A `Sequence` is the prompt
plus the tokens generated so far, how many of them already have KV in the cache, and the block
table saying where that KV lives.
"""

from __future__ import annotations

import enum

from gpuworker.engine.sampling_params import SamplingParams

# Stands in token_ids for a sampled token whose value is still on the device (async scheduling):
# the next step reads it from the device, and the host fills it in when the step's results arrive.
PLACEHOLDER_TOKEN_ID = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, group: SequenceGroup, index: int) -> None:
        self.seq_id = seq_id
        self.group = group
        # Which of the request's n choices this is.
        self.index = index
        self.token_ids: list[int] = list(group.prompt_token_ids)
        # A plain attribute, not a property: the scheduler reads it for every sequence every step.
        self.num_prompt_tokens = len(group.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the cache; the rest run through the model in coming steps.
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache (or shared from a sibling) at first admission;
        # None until admitted.
        self.num_cached_tokens: int | None = None
        self.block_table: list[int] = []
        # The sliding-window layers' blocks (engine.window_blocks), indexed as block_table: entries
        # before window_dropped have left the window and are dead (their value means nothing).
        self.window_block_table: list[int] = []
        self.window_dropped = 0
        # Chained hashes of this sequence's full blocks, filled lazily by the block manager. A full
        # block's tokens never change, so they stay valid across preemptions.
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        # The stop string or stop token id that ended the sequence, if any.
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def age_key(self) -> tuple[int, int]:
        """Orders sequences by arrival; the largest key is the newest (the first to preempt)."""
        return (self.group.arrival_index, self.index)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.group.request_id!r}, index={self.index}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )


class SequenceGroup:
    """One request: its prompt, sampling parameters and n sequences.

    With n > 1 only the first sequence is scheduled at first; the others are forked from it when
    its prompt has been computed, sharing the prompt's full blocks instead of recomputing them.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_index: int,
        max_tokens: int,
        first_seq_id: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # The request's images (engine.multimodal.MultimodalPrompt), or None.
        self.multimodal = None
        self.params = params
        self.arrival_index = arrival_index
        # params.max_tokens, or what is left of max_model_len when that is None.
        self.max_tokens = max_tokens
        self.seqs = [Sequence(first_seq_id + i, self, i) for i in range(params.n)]
        # Greedy with nothing that changes the logits or asks for more than the token: sampling
        # is a plain argmax (decided once here, as the sampler asks for every row every step).
        self.plain_greedy = (
            params.is_greedy
            and not params.has_penalties
            and params.logprobs is None
            and params.min_tokens == 0
            and params.logit_bias is None
        )
        # Siblings waiting for the first sequence's prompt to be computed.
        self.pending_forks: list[Sequence] = self.seqs[1:]
        # Device time attributed to this request: each step's duration split by tokens processed.
        self.gpu_time_s = 0.0
        # Wall-clock time (time.time()) of the first step that ran it, for the queue-time metric.
        self.first_scheduled_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def num_preemptions(self) -> int:
        return sum(seq.num_preemptions for seq in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        return self.seqs[0].num_cached_tokens or 0
