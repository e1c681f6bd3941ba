"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step fills a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
running decodes first, then running prefills (a long prompt is chunked across steps), then new
requests in arrival order. When the KV pool runs out, the newest running sequence is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed later.

Short prompts are not starved by long ones: a prompt that fits in `short_prefill_share` of the
budget is short; while one waits, long prefills leave that share of the step to it, and it may pass
long prompts waiting ahead of it. Its first token then comes within a step or two of its arrival,
however many long prompts came first (with plain FIFO it waited for all of their prefills).

Which waiting request comes next is the waiting queue's choice (engine.fair_share): arrival order,
or fair shares between tenants, interactive before batch. Every chunk a step schedules is charged
to its tenant when it is added to the step, so the next admission in the same step already sees it.
A step beside interactive work stays short: while an interactive sequence is running or waiting,
the prefill chunks of batch sequences (running prefills and new admissions together) share at most
`batch_prefill_share` of the budget (_StepBuilder.capped_budget), so the steps an interactive
request waits for or runs in are not filled with batch prompts (only a step scheduled before it
arrived can be). Batch decodes are not capped (a token each, they keep the batch streams going),
and with no interactive work batch fills the whole step.
When an interactive request finds no room, it preempts running batch sequences (_preempt_batch).
A request whose cached prefix is coming back from the host tier (engine.host_tier) keeps its place
in the queue while the requests behind it are admitted; it takes a batch sequence's seat only once
its blocks have landed.
No torch here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from gpuworker.engine.block_manager import BlockManager
from gpuworker.engine.config import EngineConfig
from gpuworker.engine.fair_share import WaitingQueue
from gpuworker.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence, SequenceGroup, SequenceStatus


class ScheduledSeq(NamedTuple):
    # A named tuple: hundreds are built per step, and a tuple is the cheapest immutable record.
    seq: Sequence
    # This step runs tokens [start, start + num_new_tokens) of the sequence.
    start: int
    num_new_tokens: int
    # Whether this step reaches the sequence's last token, so a new token is sampled from it
    # (a chunk that stops inside the prompt samples nothing).
    samples: bool


@dataclass
class ScheduledBatch:
    # Single-token entries first (the attention metadata's decode part), then longer chunks.
    seqs: list[ScheduledSeq]
    num_decode_seqs: int
    num_batched_tokens: int
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def check_admissible(config: EngineConfig, num_prompt_tokens: int, max_tokens: int | None, n: int) -> None:
    """Raise ValueError, naming the numbers, for a request that could never run."""
    max_model_len = config.max_model_len
    if num_prompt_tokens < 1:
        raise ValueError("prompt must contain at least one token")
    if max_tokens is None and num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens, which leaves no room to generate "
            f"within max_model_len ({max_model_len})"
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({max_model_len})"
        )
    # EngineConfig guarantees the pool holds max_model_len tokens, so a request that passes the
    # checks above always fits the pool once it runs alone.
    if n > config.max_num_seqs:
        raise ValueError(f"n ({n}) exceeds max_num_seqs ({config.max_num_seqs})")


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        if not config.is_resolved:
            raise ValueError("the scheduler needs a resolved config (see EngineConfig.is_resolved)")
        self.config = config
        window, num_window_blocks = config.window_pool or (None, 0)
        self.block_manager = BlockManager(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            window=window,
            num_window_blocks=num_window_blocks,
            num_host_blocks=config.num_host_kv_blocks,
        )
        self.waiting = WaitingQueue(config.scheduling)
        # In admission order.
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # A prefill with at most this many tokens left is short (0: none is, plain FIFO).
        self.short_prefill_tokens = int(config.max_num_batched_tokens * config.short_prefill_share)
        # Short sequences in `waiting`: kept exact as sequences enter and leave it, since a waiting
        # sequence's length does not change.
        self.num_short_waiting = 0
        # Prefill tokens a step gives to the classes below the best one with work.
        self.capped_prefill_tokens = max(1, int(config.max_num_batched_tokens * config.batch_prefill_share))

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int | None, n: int) -> None:
        """Raise ValueError, naming the numbers, for a request that could never run."""
        check_admissible(self.config, num_prompt_tokens, max_tokens, n)

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request's sequences; the caller has admitted it with check_admissible."""
        self.waiting.append(group.seqs[0])
        self.num_short_waiting += not self._is_long(group.seqs[0])

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """The next step, filled phase by phase within its token budget and sequence cap: running
        decodes first, so a long prefill never stalls the running streams; then running prefills;
        then new requests from the queue."""
        step = _StepBuilder(
            self.config.max_num_batched_tokens, self.config.max_num_seqs, self._best_rank(), self.capped_prefill_tokens
        )
        decodes, prefills = self._running_by_phase()
        self._schedule_decodes(step, decodes)
        self._schedule_prefills(step, prefills)
        self._admit_waiting(step)
        return step.build()

    def _best_rank(self) -> int | None:
        """The best class rank of the sequences running or waiting (None: none is); the prefills
        of the classes below it are capped in this step."""
        ranks = {self.waiting.rank(seq) for seq in self.running}
        waiting = self.waiting.best_rank()
        if waiting is not None:
            ranks.add(waiting)
        return min(ranks, default=None)

    def _running_by_phase(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences with work to do: those decoding one token, those prefilling."""
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        running_status = SequenceStatus.RUNNING
        for seq in self.running:
            if seq.status is not running_status:
                continue
            if len(seq.token_ids) - seq.num_prompt_tokens >= seq.group.max_tokens:
                # Its last token is still in flight (async scheduling) and will finish it.
                continue
            if len(seq.token_ids) - seq.num_computed_tokens == 1:
                decodes.append(seq)
            else:
                prefills.append(seq)
        return decodes, prefills

    def _schedule_decodes(self, step: _StepBuilder, decodes: list[Sequence]) -> None:
        """One token per decode, in admission order, preempting the newest sequences for a new block."""
        block_manager = self.block_manager
        block_size = block_manager.block_size
        running_status = SequenceStatus.RUNNING
        room = min(step.max_seqs, step.token_budget)
        for seq in decodes:
            if len(step.entries) >= room:
                break
            if seq.status is not running_status:
                continue  # preempted for an older sequence's room in this loop
            if seq.num_computed_tokens >= len(seq.block_table) * block_size:
                # Its new token starts a block.
                if not (block_manager.can_allocate(seq, 1) or self._make_room(seq, 1, step)):
                    continue
                block_manager.allocate(seq, 1)
            self._add_to_step(step, seq, 1)

    def _schedule_prefills(self, step: _StepBuilder, prefills: list[Sequence]) -> None:
        """The next chunk of each running prefill, short prompts first."""
        # Interactive before batch, then short ones first: a short prompt admitted in pieces
        # finishes before long ones go on.
        prefills.sort(key=lambda seq: (self.waiting.rank(seq), self._is_long(seq)))
        # Tokens long prefills leave to the short prompts waiting, while these have seats to take.
        reserve = (
            self.short_prefill_tokens if self.num_short_waiting and len(self.running) < self.config.max_num_seqs else 0
        )
        running_status = SequenceStatus.RUNNING
        for seq in prefills:
            if step.is_full:
                break
            if seq.status is not running_status:
                continue
            num_new = min(seq.num_uncomputed_tokens, self._prefill_room(step, seq, reserve))
            num_new = _within_images(seq, seq.num_computed_tokens, num_new)
            if num_new > 0 and self._make_room(seq, num_new, step):
                self.block_manager.allocate(seq, num_new)
                self._add_to_step(step, seq, num_new, prefill=True)

    def _admit_waiting(self, step: _StepBuilder) -> None:
        """Admit queued sequences (their first chunk) while the step and the pool have room; short
        prompts may pass long ones."""
        block_manager = self.block_manager
        block_size = block_manager.block_size
        max_num_seqs = self.config.max_num_seqs
        # Long prompts passed this step by short ones behind them, in queue order.
        passed: list[Sequence] = []
        # Sequences taken from the queue and not admitted in this step (the long prompts passed,
        # and those whose cached prefix is still coming back from the host tier), in queue order.
        set_aside: list[Sequence] = []
        # The sequence whose admission the last preemption made room for.
        making_room_for = None
        while self.waiting:
            seq = self.waiting.peek()
            # No new admissions in a full step (or one whose share for seq's class is spent), nor in
            # one that had to preempt (the pool is already too tight), unless it is an interactive
            # request that may take a batch sequence's place.
            full = step.is_full or self._prefill_room(step, seq, 0) <= 0
            if (full or step.preempted) and seq is not making_room_for and not self._outranks_running(seq):
                break
            long = self._is_long(seq)
            reserve = self.short_prefill_tokens if self.num_short_waiting else 0
            if long and (passed or step.token_budget <= reserve):
                # What is left is the short prompts' share; once one long prompt is passed, the
                # ones after it wait too, so long prompts still start in arrival order.
                if not self.num_short_waiting:
                    break
                passed.append(self.waiting.popleft())
                set_aside.append(passed[-1])
                continue
            seats = 1 + (len(seq.group.pending_forks) if seq.index == 0 else 0)
            if len(self.running) + seats > max_num_seqs:
                if self._outranks_running(seq) and self._awaits_restore(seq):
                    # A batch sequence gives up its seat once seq's prefix is back, not before.
                    set_aside.append(self.waiting.popleft())
                    continue
                if self._preempt_batch(seq, step):
                    making_room_for = seq
                    continue
                break
            if self._awaits_restore(seq):
                set_aside.append(self.waiting.popleft())
                continue
            matched = block_manager.match_prefix(seq)
            num_computed = len(matched) * block_size
            num_new = min(seq.num_tokens - num_computed, self._prefill_room(step, seq, reserve))
            num_new = _within_images(seq, num_computed, num_new)
            if num_new <= 0 or not block_manager.can_admit(matched, num_new):
                if num_new > 0 and self._preempt_batch(seq, step):
                    making_room_for = seq
                    continue
                break
            self.waiting.popleft()
            self.num_short_waiting -= not long
            block_manager.admit(seq, matched, num_new)
            seq.status = SequenceStatus.RUNNING
            if seq.group.first_scheduled_time is None:  # a preempted sequence keeps its first time
                seq.group.first_scheduled_time = time.time()
            self.running.append(seq)
            self._add_to_step(step, seq, num_new, prefill=True)
        self.waiting.extendleft(reversed(set_aside))

    def _awaits_restore(self, seq: Sequence) -> bool:
        """Whether seq waits for its prefix's blocks to come back from the host tier (their copies
        started by the first call); the sequences behind it are admitted meanwhile. The restore
        leaves a block free for each running sequence, so it preempts none of them."""
        return self.block_manager.start_restore(seq, reserve_blocks=len(self.running))

    def _is_long(self, seq: Sequence) -> bool:
        return seq.num_uncomputed_tokens > self.short_prefill_tokens

    def _prefill_room(self, step: _StepBuilder, seq: Sequence, reserve: int) -> int:
        """Tokens seq's next prefill chunk may take in this step: what is left of the budget, less
        the short prompts' reserve for a long one, and within its class's cap where it has one."""
        room = step.token_budget - (reserve if self._is_long(seq) else 0)
        return min(room, step.capped_budget) if step.caps(self.waiting.rank(seq)) else room

    def _add_to_step(self, step: _StepBuilder, seq: Sequence, num_new: int, prefill: bool = False) -> None:
        entry = step.add(seq, num_new, capped=prefill and step.caps(self.waiting.rank(seq)))
        self.waiting.counters.charge(seq, num_new, entry.samples)

    def _make_room(self, seq: Sequence, num_new: int, step: _StepBuilder) -> bool:
        """Preempt running sequences, batch ones first and the newest first, until seq's new
        tokens fit; False if seq itself went."""
        while not self.block_manager.can_allocate(seq, num_new):
            victim = max(self.running, key=lambda s: (self.waiting.rank(s), s.age_key))
            self._preempt_in_step(victim, step)
            if victim is seq:
                return False
        return True

    def _outranks_running(self, seq: Sequence) -> bool:
        """Whether seq is of a class served before some running sequence's (it may preempt it)."""
        rank = self.waiting.rank(seq)
        return any(self.waiting.rank(other) > rank for other in self.running)

    def _preempt_batch(self, seq: Sequence, step: _StepBuilder) -> bool:
        """Preempt the newest running sequence of a class below waiting seq's, so that seq may be
        admitted; False when none runs.

        Preemption recomputes rather than swapping the victim's KV out to host memory: it needs no
        host memory or copy bandwidth, the victim's full blocks stay in the prefix cache (freed
        blocks are evicted last-used-first, so a victim resumed soon finds most of its prompt
        there), and a batch request's latency is not what the class promises anyway. Recomputed
        greedy tokens are the same tokens, since the KV comes from the same context."""
        rank = self.waiting.rank(seq)
        below = [other for other in self.running if self.waiting.rank(other) > rank]
        if not below:
            return False
        self._preempt_in_step(max(below, key=lambda s: (self.waiting.rank(s), s.age_key)), step)
        return True

    def _preempt_in_step(self, victim: Sequence, step: _StepBuilder) -> None:
        removed = step.remove(victim)
        if removed is not None:
            self.waiting.counters.charge(victim, removed.num_new_tokens, removed.samples, sign=-1)
        self._preempt(victim)
        step.preempted.append(victim)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Preempted before newer arrivals: it goes back to the front.
        self.waiting.appendleft(seq)
        self.num_short_waiting += not self._is_long(seq)

    def advance(self, batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """Account for a launched step: its tokens are computed, and each sampling sequence gets a
        placeholder for its new token. Returns (sequence, placeholder position) per sampling entry
        still running, in batch order; sequences finished since scheduling are left alone."""
        sampling: list[tuple[Sequence, int]] = []
        block_size = self.block_manager.block_size
        for entry in batch.seqs:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = computed = entry.start + entry.num_new_tokens
            if computed // block_size > entry.start // block_size:
                # A block became full: register it. Only tokens with known values are hashed:
                # every computed one is (the placeholders of earlier steps were filled before this call).
                self.block_manager.cache_computed_blocks(seq, entry.start)
            if not entry.samples:
                continue
            sampling.append((seq, seq.num_tokens))
            seq.token_ids.append(PLACEHOLDER_TOKEN_ID)
            group = seq.group
            if seq.index == 0 and group.pending_forks:
                # The prompt is computed: siblings start from its shared blocks.
                for child in group.pending_forks:
                    self.block_manager.fork(seq, child)
                    child.status = SequenceStatus.RUNNING
                    self.running.append(child)
                group.pending_forks = []
        return sampling

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence]:
        """advance() and fill in the sampled tokens at once (synchronous stepping); returns the
        sequences that got a new token. sampled_token_ids: one id per sampling entry, in order."""
        if len(sampled_token_ids) != sum(1 for s in batch.seqs if s.samples):
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled tokens for "
                f"{sum(1 for s in batch.seqs if s.samples)} sampling sequences"
            )
        advanced = []
        for (seq, position), token_id in zip(self.advance(batch), sampled_token_ids, strict=True):
            seq.token_ids[position] = token_id
            advanced.append(seq)
        return advanced

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End seq now and free its blocks (they stay in the prefix cache)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.num_short_waiting -= not self._is_long(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def abort(self, group: SequenceGroup) -> None:
        for seq in group.pending_forks:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        group.pending_forks = []
        for seq in group.seqs:
            self.finish(seq, "abort")


class _StepBuilder:
    """The batch being assembled in one schedule() call, with what is left of its budgets."""

    def __init__(self, token_budget: int, max_seqs: int, best_rank: int | None, capped_budget: int) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        # The prefill chunks of the classes ranked below best_rank (the best class with work) share
        # capped_budget tokens of the step, within token_budget.
        self.best_rank = best_rank
        self.capped_budget = capped_budget
        # Per sequence id: the tokens of its entry counted against capped_budget.
        self._capped: dict[int, int] = {}
        self.entries: list[ScheduledSeq] = []
        self.preempted: list[Sequence] = []

    @property
    def is_full(self) -> bool:
        return self.token_budget == 0 or len(self.entries) == self.max_seqs

    def caps(self, rank: int) -> bool:
        """Whether prefill chunks of class `rank` count against capped_budget in this step."""
        return self.best_rank is not None and rank > self.best_rank

    def add(self, seq: Sequence, num_new: int, capped: bool = False) -> ScheduledSeq:
        start = seq.num_computed_tokens
        entry = ScheduledSeq(seq, start, num_new, start + num_new == len(seq.token_ids))
        self.entries.append(entry)
        self.token_budget -= num_new
        if capped:
            self.capped_budget -= num_new
            self._capped[seq.seq_id] = num_new
        return entry

    def remove(self, seq: Sequence) -> ScheduledSeq | None:
        """Take seq's entry out of the step; returns it (None if seq had none)."""
        for entry in self.entries:
            if entry.seq is seq:
                self.entries.remove(entry)
                self.token_budget += entry.num_new_tokens
                self.capped_budget += self._capped.pop(seq.seq_id, 0)
                return entry
        return None

    def build(self) -> ScheduledBatch:
        decodes = [e for e in self.entries if e.num_new_tokens == 1]
        others = [e for e in self.entries if e.num_new_tokens != 1]
        return ScheduledBatch(
            seqs=decodes + others,
            num_decode_seqs=len(decodes),
            num_batched_tokens=sum(e.num_new_tokens for e in self.entries),
            preempted=list(self.preempted),
        )


def _within_images(seq: Sequence, start: int, num_new: int) -> int:
    """num_new, cut so that the chunk does not end inside an image that must be computed whole."""
    multimodal = seq.group.multimodal
    if multimodal is None or num_new <= 0:
        return num_new
    return multimodal.chunk_end(start, start + num_new) - start
