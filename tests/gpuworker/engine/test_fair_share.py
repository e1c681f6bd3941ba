"""Fair shares between tenants and priority classes in the scheduler (engine.fair_share), torch-free:
the scheduler simulator of test_scheduler stands in for the model, and a shadow model recounts
every tenant's service from the batches the scheduler emits."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpuworker.engine.config import EngineConfig
from gpuworker.engine.fair_share import WaitingQueue
from gpuworker.engine.sampling_params import PRIORITIES, SamplingParams
from gpuworker.engine.scheduler import ScheduledBatch
from gpuworker.engine.sequence import SequenceStatus
from tests.gpuworker.engine.test_scheduler import Sim, expected_output


class ShadowService:
    """Each tenant's service recounted from the batches alone: a prompt token costs 1, an output
    token 2, divided by the tenant's weight."""

    def __init__(self) -> None:
        self.weighted: dict[str, float] = {}

    def count(self, batch: ScheduledBatch) -> None:
        for entry in batch.seqs:
            params = entry.seq.group.params
            cost = (entry.num_new_tokens - entry.samples) * 1.0 + entry.samples * 2.0
            self.weighted[params.tenant] = self.weighted.get(params.tenant, 0.0) + cost / params.tenant_weight


def backlogged(sim: Sim) -> set[str]:
    return {seq.group.params.tenant for seq in sim.scheduler.waiting}


def run_checking_gaps(sim: Sim, arrivals: dict[int, list[tuple]], bound: float) -> tuple[ShadowService, float]:
    """Run the arrivals (step -> [(request id, tenant, weight, prompt, max_tokens)]) to the end;
    returns the shadow and the largest service gap seen between two tenants over an interval in
    which both stayed backlogged (asserting it never exceeds `bound` when bound is finite)."""
    shadow = ShadowService()
    since: dict[tuple[str, str], tuple[float, float]] = {}  # pair -> their service when both became backlogged
    largest = 0.0
    step = 0
    while step <= max(arrivals) or sim.scheduler.has_unfinished:
        for request_id, tenant, weight, prompt, max_tokens in arrivals.get(step, []):
            sim.add(request_id, prompt, max_tokens, tenant=tenant, tenant_weight=weight)
        before, busy = backlogged(sim), sim.scheduler.has_unfinished
        batch = sim.step()
        # Work-conserving: a step never idles while a request is unfinished.
        assert batch.is_empty is not busy
        shadow.count(batch)
        after = backlogged(sim)
        both = {(f, g) for f in before & after for g in before & after if f < g}
        since = {pair: start for pair, start in since.items() if pair in both}
        for f, g in both:
            f0, g0 = since.setdefault((f, g), (shadow.weighted.get(f, 0.0), shadow.weighted.get(g, 0.0)))
            gap = abs((shadow.weighted.get(f, 0.0) - f0) - (shadow.weighted.get(g, 0.0) - g0))
            largest = max(largest, gap)
            assert gap <= bound, f"tenants {f} and {g}: service gap {gap} over {bound}"
        step += 1
        assert step < 5000, "the scheduler made no progress"
    return shadow, largest


request_strategy = st.tuples(
    st.sampled_from(["a", "b", "c"]),  # tenant
    st.integers(1, 24),  # prompt length
    st.integers(1, 8),  # max_tokens
    st.integers(0, 30),  # arrival step
)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(request_strategy, min_size=2, max_size=40),
    weights=st.fixed_dictionaries({t: st.sampled_from([1.0, 2.0, 3.0]) for t in "abc"}),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(1, 4),
)
def test_backlogged_tenants_stay_within_twice_the_most_served_at_once(requests, weights, budget, max_num_seqs):
    max_model_len = 32
    # A pool that holds every seat's longest sequence: no preemption, whose recomputation is service too.
    sim = Sim(
        block_size=4,
        max_model_len=max_model_len,
        num_kv_blocks=max_num_seqs * max_model_len // 4,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        scheduling="fair",
    )
    arrivals: dict[int, list[tuple]] = {}
    for i, (tenant, prompt_len, max_tokens, at) in enumerate(requests):
        prompt = [(i * 7 + k) % 50 for k in range(prompt_len)]
        arrivals.setdefault(at, []).append((str(i), tenant, weights[tenant], prompt, max_tokens))
    # The most one tenant can be served at once, in its own virtual tokens: a full batch of its
    # longest requests at the smallest weight.
    most_at_once = max_num_seqs * max(p + 2 * m for _, p, m, _ in requests) / min(weights.values())
    shadow, largest = run_checking_gaps(sim, arrivals, 2 * most_at_once)
    event(f"gap above one batch: {largest > most_at_once / max_num_seqs}")
    assert sim.scheduler.num_preemptions == 0
    counters = sim.scheduler.waiting.counters
    assert {tenant for tenant, _ in counters.served} == shadow.weighted.keys()
    for tenant, weighted in shadow.weighted.items():
        assert counters.served[tenant, "interactive"] / weights[tenant] == pytest.approx(weighted)
    for group in sim.groups.values():
        assert group.seqs[0].output_token_ids == expected_output(group.prompt_token_ids, group.max_tokens)


def flood_arrivals() -> dict[int, list[tuple]]:
    """Tenant b floods 40 requests at once, then tenant a sends one request every other step."""
    arrivals: dict[int, list[tuple]] = {0: [(f"b{i}", "b", 1.0, [1, 2, 3, 4, 5, 6, 7, 8], 8) for i in range(40)]}
    for k in range(20):
        arrivals.setdefault(2 * k + 1, []).append((f"a{k}", "a", 1.0, [9, 8, 7, 6, 5, 4, 3, 2], 8))
    return arrivals


def test_arrival_order_lets_a_flooding_tenant_starve_a_quiet_one_and_fair_shares_do_not():
    bound = 2 * 2 * (8 + 2 * 8)  # twice a full batch (2 seats) of one request's cost
    config = dict(block_size=4, max_model_len=32, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=2)
    _, fcfs_gap = run_checking_gaps(Sim(scheduling="fcfs", **config), flood_arrivals(), float("inf"))
    assert fcfs_gap > bound  # the shadow's bound does catch unfair admission
    run_checking_gaps(Sim(scheduling="fair", **config), flood_arrivals(), bound)


def service_while_both_backlogged(weight_a: float, weight_b: float) -> tuple[float, float]:
    sim = Sim(block_size=4, max_model_len=32, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(60):
        sim.add(f"a{i}", [1, 2, 3, 4], 4, tenant="a", tenant_weight=weight_a)
        sim.add(f"b{i}", [5, 6, 7, 8], 4, tenant="b", tenant_weight=weight_b)
    shadow = ShadowService()
    while backlogged(sim) == {"a", "b"}:
        shadow.count(sim.step())
    counters = sim.scheduler.waiting.counters
    return counters.served["a", "interactive"], counters.served["b", "interactive"]


def test_a_tenant_of_weight_two_gets_twice_the_service_of_weight_one():
    heavy, light = service_while_both_backlogged(2.0, 1.0)
    assert heavy / light == pytest.approx(2.0, rel=0.15)
    even_a, even_b = service_while_both_backlogged(1.0, 1.0)
    assert even_a / even_b == pytest.approx(1.0, rel=0.15)


def test_a_tenant_back_from_idle_gets_no_burst_of_back_credit():
    sim = Sim(block_size=4, max_model_len=32, num_kv_blocks=256, max_num_batched_tokens=16, max_num_seqs=2)
    for i in range(30):
        sim.add(f"b{i}", [5, 6, 7, 8], 4, tenant="b")
    for _ in range(20):
        sim.step()
    counters = sim.scheduler.waiting.counters
    sim.add("a0", [1, 2, 3, 4], 4, tenant="a")
    # Lifted to the backlogged tenant's counter: a starts level with b, not 20 steps behind it.
    assert counters.virtual["a"] == counters.virtual["b"] > 0
    for i in range(1, 10):
        sim.add(f"a{i}", [1, 2, 3, 4], 4, tenant="a")
    admitted = []
    while len(admitted) < 8:
        admitted += [e.seq.group.params.tenant for e in sim.step().seqs if e.start == 0]
    # From level counters, the two alternate rather than a taking eight in a row.
    assert 3 <= admitted[:8].count("a") <= 5


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6), st.integers(0, 8)), min_size=1, max_size=12))
def test_requests_without_a_tenant_are_scheduled_exactly_as_in_arrival_order(requests):
    runs = []
    for scheduling in ("fcfs", "fair"):
        sim = Sim(num_kv_blocks=12, max_model_len=32, max_num_batched_tokens=16, max_num_seqs=3, scheduling=scheduling)
        arrivals: dict[int, list] = {}
        for i, (prompt_len, max_tokens, at) in enumerate(requests):
            arrivals.setdefault(at, []).append((str(i), [(i + k) % 5 for k in range(prompt_len)], max_tokens))
        trace, step = [], 0
        while step <= max(arrivals) or sim.scheduler.has_unfinished:
            for request_id, prompt, max_tokens in arrivals.get(step, []):
                sim.add(request_id, prompt, max_tokens)
            batch = sim.step()
            trace.append([(e.seq.group.request_id, e.start, e.num_new_tokens) for e in batch.seqs])
            step += 1
        runs.append(trace)
    assert runs[0] == runs[1]


def test_interactive_is_admitted_before_batch_that_came_first():
    sim = Sim(max_num_seqs=1)
    sim.add("batch", 4, priority="batch")
    sim.add("chat", 4)
    assert [e.seq.group.request_id for e in sim.step().seqs] == ["chat"]


def test_an_interactive_request_takes_the_seat_of_a_running_batch_sequence():
    sim = Sim(max_num_seqs=1)
    batch_job = sim.add("batch", [1, 2, 3], max_tokens=8, priority="batch")
    sim.step()
    sim.step()
    chat = sim.add("chat", [4, 5, 6], max_tokens=3)
    step = sim.step()
    assert [e.seq.group.request_id for e in step.seqs] == ["chat"]
    assert step.preempted == [batch_job.seqs[0]] and batch_job.seqs[0].status is SequenceStatus.WAITING
    sim.run()
    assert chat.seqs[0].output_token_ids == expected_output([4, 5, 6], 3)
    # Recomputed after the preemption, the batch request's tokens are those of running alone.
    assert batch_job.seqs[0].output_token_ids == expected_output([1, 2, 3], 8)


def test_an_interactive_request_preempts_batch_sequences_when_kv_blocks_run_short():
    # 8 blocks of 4 tokens: two batch sequences of 12 tokens take 6 of them.
    sim = Sim(num_kv_blocks=8, max_model_len=32, max_num_seqs=8)
    jobs = [sim.add(f"batch{i}", [i] * 8, max_tokens=4, priority="batch") for i in range(2)]
    sim.step()
    chat = sim.add("chat", [7] * 12, max_tokens=4)
    step = sim.step()
    assert "chat" in [e.seq.group.request_id for e in step.seqs]
    assert step.preempted == [jobs[1].seqs[0]]  # the newest batch sequence, only as many as needed
    sim.run()
    assert chat.seqs[0].output_token_ids == expected_output([7] * 12, 4)
    for i, job in enumerate(jobs):
        assert job.seqs[0].output_token_ids == expected_output([i] * 8, 4)


def test_batch_never_preempts_interactive_and_arrival_order_preempts_nothing_for_a_class():
    sim = Sim(max_num_seqs=1)
    sim.add("chat", 3, max_tokens=6)
    sim.step()
    sim.add("batch", 3, priority="batch")
    assert [e.seq.group.request_id for e in sim.step().seqs] == ["chat"] and sim.scheduler.num_preemptions == 0
    fcfs = Sim(max_num_seqs=1, scheduling="fcfs")
    fcfs.add("batch", 3, max_tokens=6, priority="batch")
    fcfs.step()
    fcfs.add("chat", 3)
    assert [e.seq.group.request_id for e in fcfs.step().seqs] == ["batch"] and fcfs.scheduler.num_preemptions == 0


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("tenant", "", "tenant must be a non-empty string"),
        ("tenant", 7, "tenant must be a non-empty string"),
        ("tenant_weight", 0, "tenant_weight must be greater than 0"),
        ("tenant_weight", 5000, "tenant_weight must be at most"),
        ("priority", "urgent", "priority must be one of interactive, batch"),
    ],
)
def test_bad_tenant_fields_are_refused_by_name(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_an_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling must be one of"):
        EngineConfig(model="unused", scheduling="lottery")
    with pytest.raises(ValueError, match="scheduling must be one of"):
        WaitingQueue("lottery")


def batch_prefill_tokens(batch: ScheduledBatch, decoding: set[int]) -> int:
    """The tokens of the batch class's prefill chunks in a step (decoding: ids of the sequences
    that were decoding when it was scheduled)."""
    return sum(
        e.num_new_tokens for e in batch.seqs if e.seq.group.params.priority == "batch" and id(e.seq) not in decoding
    )


def step_counting_batch_prefill(sim: Sim) -> tuple[ScheduledBatch, int]:
    decoding = {id(seq) for seq in sim.scheduler.running if seq.num_tokens - seq.num_computed_tokens == 1}
    batch = sim.step()
    return batch, batch_prefill_tokens(batch, decoding)


def flood_beside_chat(chat: bool, **overrides) -> Sim:
    """Eight 40-token batch prompts queued (budget 32 tokens a step), beside an interactive
    request already decoding when chat is True."""
    config = dict(max_model_len=64, num_kv_blocks=128, max_num_batched_tokens=32, max_num_seqs=16)
    sim = Sim(**{**config, **overrides})
    if chat:
        sim.add("chat", [9, 9, 9], max_tokens=16)
        sim.step()
    for i in range(8):
        sim.add(f"batch{i}", [i + 1] + [0] * 39, max_tokens=4, priority="batch")
    return sim


@pytest.mark.parametrize(("share", "cap"), [(0.25, 8), (0.5, 16)])
def test_batch_prefill_takes_only_its_share_of_a_step_beside_interactive_work_and_all_of_it_alone(share, cap):
    """The fair policy's cap on batch prefill, against arrival order, which caps nothing."""
    sim = flood_beside_chat(chat=True, batch_prefill_share=share)
    chat = sim.groups["chat"].seqs[0]
    seen = []
    while not chat.is_finished:
        _, tokens = step_counting_batch_prefill(sim)
        seen.append(tokens)
    # Capped in every step while the chat decodes, and the cap used (batch prefills still progress).
    assert max(seen) == cap and min(seen[:-1]) > 0
    # The chat gone, batch prefills fill the step (beside the batch decodes).
    batch, tokens = step_counting_batch_prefill(sim)
    assert batch.num_batched_tokens == 32 and tokens > cap
    alone = flood_beside_chat(chat=False, batch_prefill_share=share)
    assert step_counting_batch_prefill(alone)[1] == 32
    # Arrival order has no classes to cap: the chat's decode and 31 tokens of batch prefill.
    fcfs = flood_beside_chat(chat=True, batch_prefill_share=share, scheduling="fcfs")
    assert step_counting_batch_prefill(fcfs)[1] == 31
    sim.run()
    for group in sim.groups.values():
        assert group.seqs[0].output_token_ids == expected_output(group.prompt_token_ids, group.max_tokens)


def test_a_running_batch_prefill_is_chunked_to_the_cap_while_an_interactive_request_runs():
    # Budget 32, cap 8: the batch prompt takes a whole step alone, then 8 tokens a step beside the
    # chat, then whole steps again once the chat is done.
    sim = Sim(max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=32, batch_prefill_share=0.25)
    batch_job = sim.add("batch", [1] + [0] * 99, max_tokens=2, priority="batch")
    chunks = [entry.num_new_tokens for entry in sim.step().seqs]
    chat = sim.add("chat", [4, 5, 6], max_tokens=3)
    while batch_job.seqs[0].num_output_tokens == 0:
        batch = sim.step()
        chunks += [e.num_new_tokens for e in batch.seqs if e.seq is batch_job.seqs[0]]
    assert chunks == [32, 8, 8, 8, 32, 12]
    sim.run()
    assert chat.seqs[0].output_token_ids == expected_output([4, 5, 6], 3)
    assert batch_job.seqs[0].output_token_ids == expected_output([1] + [0] * 99, 2)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.sampled_from(PRIORITIES), st.integers(1, 24), st.integers(1, 6), st.integers(0, 12)),
        min_size=1,
        max_size=12,
    ),
    budget=st.integers(2, 40),
    share=st.sampled_from([0.1, 0.25, 0.5, 1.0]),
    extra_blocks=st.integers(0, 8),
    max_num_seqs=st.integers(1, 4),
)
def test_batch_prefill_stays_within_its_share_while_interactive_work_is_present(
    requests, budget, share, extra_blocks, max_num_seqs
):
    # A pool as small as one longest sequence: preemption, interactive over batch, is frequent.
    sim = Sim(
        max_model_len=32,
        num_kv_blocks=8 + extra_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        batch_prefill_share=share,
    )
    cap = max(1, int(budget * share))
    arrivals: dict[int, list[tuple]] = {}
    for i, (priority, prompt_len, max_tokens, at) in enumerate(requests):
        prompt = [(i * 5 + k) % 3 for k in range(prompt_len)]
        arrivals.setdefault(at, []).append((str(i), prompt, max_tokens, priority))
    step = 0
    while step <= max(arrivals) or sim.scheduler.has_unfinished:
        for request_id, prompt, max_tokens, priority in arrivals.get(step, []):
            sim.add(request_id, prompt, max_tokens, priority=priority)
        scheduler = sim.scheduler
        interactive = any(
            seq.group.params.priority == "interactive" for seq in [*scheduler.running, *scheduler.waiting]
        )
        _, tokens = step_counting_batch_prefill(sim)
        if interactive:
            assert tokens <= cap
        step += 1
        assert step < 2000, "the scheduler made no progress"
    event(f"preempted: {sim.scheduler.num_preemptions > 0}")
    for group in sim.groups.values():
        for seq in group.seqs:
            assert seq.output_token_ids == expected_output(group.prompt_token_ids, group.max_tokens)
