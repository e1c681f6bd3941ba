"""Scheduler: budgets, decodes first, chunked prefill, preemption, n choices, admission errors.

torch-free: a small simulator stands in for the model. It keeps a shadow KV cache holding, for
every slot written, the token prefix its K/V would have been computed from, and checks before each
step that everything a sequence would attend to is exactly its own prefix.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpuworker.engine.config import EngineConfig
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.scheduler import ScheduledBatch, Scheduler
from gpuworker.engine.sequence import SequenceGroup, SequenceStatus


def next_token(token_ids: list[int], index: int) -> int:
    """The 'model': a deterministic function of the whole context (so recomputation must agree)."""
    return (sum(token_ids) * 7 + len(token_ids) + index) % 3


class Sim:
    def __init__(self, **overrides) -> None:
        kwargs = dict(
            model="unused", block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8
        )
        kwargs.update(overrides)
        self.config = EngineConfig(**kwargs)
        self.scheduler = Scheduler(self.config)
        self.bm = self.scheduler.block_manager
        self.groups: dict[str, SequenceGroup] = {}
        self.shadow: dict[tuple[int, int], tuple[int, ...]] = {}
        self._arrivals = 0

    def add(self, request_id: str, prompt: list[int] | int, max_tokens: int = 4, n: int = 1, **params) -> SequenceGroup:
        """params: more SamplingParams fields (tenant, tenant_weight, priority)."""
        tokens = list(range(prompt)) if isinstance(prompt, int) else prompt
        group = SequenceGroup(
            request_id,
            tokens,
            SamplingParams(n=n, max_tokens=max_tokens, **params),
            self._arrivals,
            max_tokens,
            first_seq_id=self._arrivals * 100,
        )
        self._arrivals += 1
        self.scheduler.add(group)
        self.groups[request_id] = group
        return group

    def step(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self.check_batch(batch)
        sampled = []
        for entry in batch.seqs:
            seq, bs = entry.seq, self.config.block_size
            for pos in range(entry.start, entry.start + entry.num_new_tokens):
                self.shadow[(seq.block_table[pos // bs], pos % bs)] = tuple(seq.token_ids[: pos + 1])
            if entry.samples:
                sampled.append(next_token(seq.token_ids, seq.index))
        for seq in self.scheduler.postprocess(batch, sampled):
            if seq.num_output_tokens >= seq.group.max_tokens:
                self.scheduler.finish(seq, "length")
        return batch

    def check_batch(self, batch: ScheduledBatch) -> None:
        config, bs = self.config, self.config.block_size
        assert batch.num_batched_tokens == sum(e.num_new_tokens for e in batch.seqs)
        assert batch.num_batched_tokens <= config.max_num_batched_tokens
        assert len(batch.seqs) <= config.max_num_seqs
        assert len({id(e.seq) for e in batch.seqs}) == len(batch.seqs)
        assert all(e.num_new_tokens == 1 for e in batch.seqs[: batch.num_decode_seqs])
        assert all(e.num_new_tokens > 1 for e in batch.seqs[batch.num_decode_seqs :])
        for entry in batch.seqs:
            seq = entry.seq
            assert seq.status is SequenceStatus.RUNNING and entry.start == seq.num_computed_tokens
            assert len(seq.block_table) * bs >= entry.start + entry.num_new_tokens
            for pos in range(entry.start):  # the context it will attend to
                assert self.shadow[(seq.block_table[pos // bs], pos % bs)] == tuple(seq.token_ids[: pos + 1])
        scheduler = self.scheduler
        assert scheduler.num_short_waiting == sum(
            seq.num_tokens <= scheduler.short_prefill_tokens for seq in scheduler.waiting
        )

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.scheduler.has_unfinished:
            self.step()
            steps += 1
            assert steps < max_steps, "the scheduler made no progress"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        return steps


def expected_output(prompt: list[int], max_tokens: int, index: int = 0) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, index))
    return tokens[len(prompt) :]


def test_long_prompt_is_chunked_and_samples_only_at_its_end():
    sim = Sim(max_num_batched_tokens=16)
    sim.add("a", 50, max_tokens=2)
    chunks = []
    for _ in range(4):
        (entry,) = sim.step().seqs
        chunks.append((entry.num_new_tokens, entry.samples))
    assert chunks == [(16, False), (16, False), (16, False), (2, True)]
    assert sim.groups["a"].seqs[0].num_output_tokens == 1


def test_decodes_first_then_prefill_chunks_fill_the_budget():
    sim = Sim(max_num_batched_tokens=8)
    sim.add("a", 3)
    sim.add("b", 3)
    sim.step()  # both prompts in one step
    sim.add("long", 20)
    batch = sim.step()
    assert [e.seq.group.request_id for e in batch.seqs] == ["a", "b", "long"]
    assert batch.num_decode_seqs == 2
    assert [e.num_new_tokens for e in batch.seqs] == [1, 1, 6]
    assert not batch.seqs[2].samples


def test_running_prefill_continues_before_new_admissions():
    sim = Sim(max_num_batched_tokens=10)
    sim.add("first", 25)
    sim.step()
    sim.add("second", 5)
    batch = sim.step()
    assert [(e.seq.group.request_id, e.num_new_tokens) for e in batch.seqs] == [("first", 10)]


def distinct_prompt(index: int, length: int) -> list[int]:
    """A prompt sharing no prefix with the others (which the prefix cache would shorten)."""
    return [index] + [0] * (length - 1)


def steps_to_first_token_behind(num_long: int, **overrides) -> int:
    """Steps from a short prompt's arrival to its first token, with num_long long prompts ahead of
    it (the first one already prefilling)."""
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=32, num_kv_blocks=1024, **overrides)
    for i in range(num_long):
        sim.add(f"long{i}", distinct_prompt(i, 56))
    sim.step()
    short = sim.add("short", distinct_prompt(num_long, 8))
    steps = 0
    while not short.seqs[0].num_output_tokens:
        sim.step()
        steps += 1
    return steps


@pytest.mark.parametrize("num_long", [1, 4, 16])
def test_a_short_prompt_behind_long_ones_gets_its_first_token_at_the_next_step(num_long):
    assert steps_to_first_token_behind(num_long) == 1
    # In plain arrival order it waits for every long prefill ahead of it.
    assert steps_to_first_token_behind(num_long, short_prefill_share=0) >= num_long * 56 // 64


def test_short_prompts_pass_long_ones_in_the_budget_long_prefills_leave_them():
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=32, num_kv_blocks=1024)
    assert sim.scheduler.short_prefill_tokens == 8  # 1/8 of the budget
    for i in range(4):
        sim.add(f"long{i}", distinct_prompt(i, 56))
    sim.step()  # long0 whole, long1's first 8 tokens
    sim.add("short", distinct_prompt(4, 8))
    batch = sim.step()
    # long1 goes on and long2 starts, leaving 8 tokens; long3 is passed by the short prompt.
    assert [(e.seq.group.request_id, e.num_new_tokens) for e in batch.seqs] == [
        ("long0", 1),
        ("long1", 48),
        ("long2", 7),
        ("short", 8),
    ]
    assert batch.num_batched_tokens == 64
    assert [seq.group.request_id for seq in sim.scheduler.waiting] == ["long3"]


def test_a_long_prefill_keeps_its_share_while_short_prompts_stream_in():
    sim = Sim(max_num_batched_tokens=16, max_num_seqs=64, num_kv_blocks=1024)  # short: <= 2 tokens
    long = sim.add("long", 60)
    steps = 0
    while long.seqs[0].num_computed_tokens < 60:
        for i in range(3):
            sim.add(f"short{steps}-{i}", 2, max_tokens=1)
        sim.step()
        steps += 1
    assert steps == 5  # 14 tokens a step: the short prompts get 2
    sim.run()


def test_max_num_seqs_caps_the_batch():
    sim = Sim(max_num_seqs=2)
    for i in range(5):
        sim.add(str(i), 3)
    batch = sim.step()
    assert [e.seq.group.request_id for e in batch.seqs] == ["0", "1"]
    assert len(sim.scheduler.waiting) == 3


def test_newest_running_sequence_is_preempted_and_recomputed():
    # 6 blocks of 4 tokens; two requests of 8 + 8 tokens need 4 blocks each by the end.
    sim = Sim(num_kv_blocks=6, max_model_len=24)
    old = sim.add("old", list(range(7)), max_tokens=9)
    new = sim.add("new", list(range(10, 17)), max_tokens=9)
    preempted = []
    while sim.scheduler.has_unfinished:
        preempted += [s.group.request_id for s in sim.step().preempted]
    assert preempted and set(preempted) == {"new"}
    assert new.num_preemptions == len(preempted) and sim.scheduler.num_preemptions == len(preempted)
    assert old.seqs[0].output_token_ids == expected_output(list(range(7)), 9)
    assert new.seqs[0].output_token_ids == expected_output(list(range(10, 17)), 9)


def test_preempted_sequence_goes_back_to_the_front_with_no_blocks():
    sim = Sim(num_kv_blocks=4, max_model_len=16)
    sim.add("a", list(range(7)), max_tokens=9)
    sim.add("b", list(range(20, 27)), max_tokens=9)
    sim.add("c", 2)
    while not sim.scheduler.num_preemptions:
        batch = sim.step()
    (victim,) = batch.preempted
    assert victim.group.request_id == "b" and victim.status is SequenceStatus.WAITING
    assert sim.scheduler.waiting[0] is victim
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    # No new admission in the step that preempted.
    assert all(e.seq.group.request_id == "a" for e in batch.seqs)


def test_n_choices_share_the_prompt_blocks():
    sim = Sim()
    group = sim.add("g", 10, max_tokens=3, n=3)
    first = sim.step()
    assert [e.seq.index for e in first.seqs] == [0]
    parent, *children = group.seqs
    assert all(child.block_table == parent.block_table[:2] for child in children)
    assert sim.bm.blocks[parent.block_table[0]].ref_count == 3
    second = sim.step()
    # Each child computes only the prompt's tail (tokens 8..9) before sampling.
    assert sorted((e.seq.index, e.start, e.num_new_tokens) for e in second.seqs) == [(0, 10, 1), (1, 8, 2), (2, 8, 2)]
    sim.run()
    assert all(seq.output_token_ids == expected_output(list(range(10)), 3, seq.index) for seq in group.seqs)


def test_max_num_seqs_reserves_seats_for_the_siblings():
    sim = Sim(max_num_seqs=3)
    sim.add("pair", 5, n=2)
    sim.add("triple", 5, n=3)
    batch = sim.step()
    # pair's parent runs and holds a seat for its sibling: 1 + 1 + 3 > 3 leaves triple waiting.
    assert [e.seq.group.request_id for e in batch.seqs] == ["pair"]
    assert [s.group.request_id for s in sim.scheduler.running] == ["pair", "pair"]
    assert sim.scheduler.waiting[0].group.request_id == "triple"


def test_second_request_with_the_same_prompt_hits_the_prefix_cache():
    sim = Sim()
    sim.add("a", 18, max_tokens=1)
    sim.run()
    again = sim.add("b", 18, max_tokens=1)
    (entry,) = sim.step().seqs
    assert again.num_cached_tokens == 16 and entry.start == 16 and entry.num_new_tokens == 2


def test_finish_and_abort_free_blocks_at_once():
    sim = Sim()
    sim.add("a", 10, max_tokens=50)
    group = sim.add("b", 10, max_tokens=50, n=2)
    sim.step()
    sim.scheduler.abort(group)
    assert all(seq.finish_reason == "abort" for seq in group.seqs)
    sim.scheduler.abort(sim.groups["a"])
    assert not sim.scheduler.has_unfinished
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


@pytest.mark.parametrize(
    "prompt_len, max_tokens, match",
    [
        (60, 5, r"prompt \(60 tokens\) \+ max_tokens \(5\) = 65 exceeds max_model_len \(64\)"),
        (64, None, r"prompt has 64 tokens, which leaves no room .* max_model_len \(64\)"),
        (0, 1, "at least one token"),
    ],
)
def test_admission_rejects_what_cannot_fit(prompt_len, max_tokens, match):
    sim = Sim()
    with pytest.raises(ValueError, match=match):
        sim.scheduler.check_admissible(prompt_len, max_tokens, 1)


def test_admission_rejects_n_beyond_max_num_seqs():
    with pytest.raises(ValueError, match=r"n \(9\) exceeds max_num_seqs \(8\)"):
        Sim().scheduler.check_admissible(4, 4, 9)


def test_needs_a_resolved_config():
    with pytest.raises(ValueError, match="resolved"):
        Scheduler(EngineConfig(model="unused"))


request_strategy = st.tuples(
    st.lists(st.integers(0, 2), min_size=1, max_size=24),  # prompt over a tiny alphabet: shared prefixes
    st.integers(1, 8),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 6),  # arrival step
)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=8),
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.integers(0, 3),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(3, 6),
    prefix_caching=st.booleans(),
    short_share=st.sampled_from([0.0, 0.125, 0.5]),
)
def test_every_request_completes_correctly_under_any_budget(
    requests, block_size, extra_blocks, budget, max_num_seqs, prefix_caching, short_share
):
    max_model_len = 32
    sim = Sim(
        block_size=block_size,
        max_model_len=max_model_len,
        num_kv_blocks=max_model_len // block_size + extra_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
        short_prefill_share=short_share,
    )
    arrivals: dict[int, list] = {}
    for i, (prompt, max_tokens, n, at) in enumerate(requests):
        arrivals.setdefault(at, []).append((str(i), prompt, max_tokens, n))
    step = 0
    while step <= max(arrivals) or sim.scheduler.has_unfinished:
        for request_id, prompt, max_tokens, n in arrivals.get(step, []):
            sim.add(request_id, prompt, max_tokens, n)
        sim.step()
        step += 1
        assert step < 2000, "the scheduler made no progress"
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    event(f"preempted: {sim.scheduler.num_preemptions > 0}")
    event(f"prefix hits: {sim.bm.prefix_cache_hits > 0}")
    for request_id, prompt, max_tokens, _n in (r for rs in arrivals.values() for r in rs):
        for seq in sim.groups[request_id].seqs:
            assert seq.output_token_ids == expected_output(prompt, max_tokens, seq.index)
