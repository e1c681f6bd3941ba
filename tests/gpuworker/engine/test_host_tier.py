"""The host KV tier's bookkeeping, torch-free: evicted cached blocks spill to it, a prefix that
continues there is restored into held GPU blocks (copies listed for the runner), its slots are LRU
and never reused while a restore reads them, and the scheduler admits the sequences behind one
whose restore is in flight."""

from __future__ import annotations

import itertools

import pytest

from gpuworker.engine.block_manager import BlockManager
from gpuworker.engine.config import EngineConfig
from gpuworker.engine.host_tier import HostTier
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.scheduler import Scheduler
from gpuworker.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.gpuworker.engine.test_block_manager import make_seq, run_prompt

BLOCK_SIZE = 4
_arrivals = itertools.count()


def fill_and_evict(bm: BlockManager, tokens: list[int]) -> None:
    """Run tokens as a prompt, free it, then run enough other prompts to evict all of it."""
    seq = make_seq(tokens)
    run_prompt(bm, seq)
    bm.free(seq)
    other = make_seq([1000 + i for i in range(bm.num_blocks * BLOCK_SIZE - 1)])
    run_prompt(bm, other)
    bm.free(other)


def test_evicted_prefix_is_restored_with_its_copies_listed():
    bm = BlockManager(8, BLOCK_SIZE, num_host_blocks=16)
    prompt = list(range(13))  # three full blocks and a partial one
    fill_and_evict(bm, prompt)
    spills, _ = bm.take_pending_copies()
    assert len(spills) >= 3 and len({slot for _, slot in spills}) == len(spills)
    again = make_seq(prompt + [50])
    assert bm.match_prefix(again) == []  # gone from the GPU
    assert bm.start_restore(again) is True
    assert bm.start_restore(again) is True  # still in flight: no second restore
    spills, restores = bm.take_pending_copies()
    [(seq_id, copies)] = restores
    assert seq_id == again.seq_id and len(copies) == 3
    held = [block_id for _, block_id in copies]
    assert all(bm.blocks[b].ref_count == 1 for b in held)  # not evictable while the copy runs
    assert bm.host_cache_hits == 3 * BLOCK_SIZE
    bm.restore_landed(again.seq_id)
    assert bm.start_restore(again) is False
    assert bm.match_prefix(again) == held
    run_prompt(bm, again)
    assert again.num_cached_tokens == 12


def test_gpu_hits_before_host_hits_are_held_during_the_restore():
    bm = BlockManager(8, BLOCK_SIZE, num_host_blocks=16)
    prompt = list(range(17))
    fill_and_evict(bm, prompt)
    bm.take_pending_copies()
    first = make_seq(prompt[:5])  # brings the first block back onto the GPU
    run_prompt(bm, first)
    bm.free(first)
    seq = make_seq(prompt + [1])
    assert bm.start_restore(seq)
    _, [(_, copies)] = bm.take_pending_copies()
    assert len(copies) == 3  # the other three blocks; the first is on the GPU, held
    assert bm.blocks[first.block_hashes and bm._cached[first.block_hashes[0]]].ref_count == 1
    bm.restore_landed(seq.seq_id)
    assert len(bm.match_prefix(seq)) == 4


def test_restore_is_cut_to_the_free_blocks():
    bm = BlockManager(8, BLOCK_SIZE, num_host_blocks=16)
    prompt = list(range(25))  # six full blocks
    fill_and_evict(bm, prompt)
    bm.take_pending_copies()
    busy = make_seq([2000 + i for i in range(20)])  # five blocks in use
    run_prompt(bm, busy)
    seq = make_seq(prompt + [1])
    assert bm.start_restore(seq)
    _, [(_, copies)] = bm.take_pending_copies()
    assert len(copies) == 3
    assert bm.num_free_blocks == 0


def test_finished_while_restoring_lands_unused():
    bm = BlockManager(8, BLOCK_SIZE, num_host_blocks=16)
    prompt = list(range(13))
    fill_and_evict(bm, prompt)
    seq = make_seq(prompt + [1])
    assert bm.start_restore(seq)
    bm.free(seq)  # aborted while waiting
    assert bm.has_restores_in_flight
    bm.restore_landed(seq.seq_id)
    assert not bm.has_restores_in_flight and bm.num_free_blocks == 8
    assert seq.seq_id not in bm._restored


def test_host_tier_is_lru_and_keeps_pinned_slots():
    tier = HostTier(2)
    tier.spill(0, 10, (1,), 1, 0)
    tier.spill(1, 11, (2,), 2, 1)
    tier.pin(tier.lookup(10, (1,), 0))  # 10 is being restored (and becomes most recent)
    tier.spill(2, 12, (3,), 3, 2)  # evicts 11, the least recently used unpinned
    assert 10 in tier and 12 in tier and 11 not in tier
    assert tier.num_evicted == 1
    tier.pin(tier.lookup(12, (3,), 2))
    tier.spill(3, 13, (4,), 4, 3)  # every slot pinned: dropped
    assert 13 not in tier
    assert [slot for _, slot in tier.take_pending_spills()] == [0, 1, 1]
    tier.spill(4, 10, (1,), 1, 0)  # held already: no copy
    assert tier.take_pending_spills() == []


def test_lookup_checks_tokens_and_parent():
    tier = HostTier(4)
    tier.spill(0, 10, (1, 2), 5, 0)
    assert tier.lookup(10, (1, 2), 0) is not None
    assert tier.lookup(10, (1, 3), 0) is None  # a colliding hash
    assert tier.lookup(10, (1, 2), 9) is None  # under another parent
    with pytest.raises(ValueError, match="at least one slot"):
        HostTier(0)


def test_scheduler_admits_others_while_a_restore_is_in_flight():
    config = EngineConfig(
        model="unused",
        block_size=BLOCK_SIZE,
        num_kv_blocks=8,
        max_model_len=32,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        num_host_kv_blocks=16,
    )
    scheduler = Scheduler(config)
    bm = scheduler.block_manager
    prompt = list(range(13))
    fill_and_evict(bm, prompt)
    restoring, other = make_seq(prompt + [1]), make_seq([3000, 3001])
    for seq in (restoring, other):
        scheduler.add(seq.group)
    batch = scheduler.schedule()
    assert [entry.seq for entry in batch.seqs] == [other]
    assert restoring.status is SequenceStatus.WAITING and scheduler.waiting[0] is restoring
    scheduler.advance(batch)
    assert restoring not in [entry.seq for entry in scheduler.schedule().seqs]  # still in flight
    bm.restore_landed(restoring.seq_id)
    [entry] = [entry for entry in scheduler.schedule().seqs if entry.seq is restoring]
    assert entry.start == 12


def tiered_scheduler(max_num_seqs: int = 4) -> Scheduler:
    config = EngineConfig(
        model="unused",
        block_size=BLOCK_SIZE,
        num_kv_blocks=8,
        max_model_len=32,
        max_num_batched_tokens=64,
        max_num_seqs=max_num_seqs,
        num_host_kv_blocks=16,
    )
    return Scheduler(config)


def queue(scheduler: Scheduler, tokens: list[int], **params) -> Sequence:
    """Queue a request of tokens; params: more SamplingParams fields (tenant, priority)."""
    arrival = next(_arrivals)
    params = SamplingParams(max_tokens=8, **params)
    group = SequenceGroup(f"q{arrival}", tokens, params, arrival, 8, first_seq_id=1000 + 16 * arrival)
    scheduler.add(group)
    return group.seqs[0]


def test_a_restoring_sequence_keeps_its_place_in_its_tenants_lane():
    """Fair shares: while tenant a's first request waits for its prefix, a's next request and
    tenant b's are admitted; the first stays at the front of a's lane and runs once it lands."""
    scheduler = tiered_scheduler()
    prompt = list(range(13))
    fill_and_evict(scheduler.block_manager, prompt)
    restoring = queue(scheduler, prompt + [1], tenant="a")
    behind = queue(scheduler, [3000, 3001], tenant="a")
    other = queue(scheduler, [4000, 4001], tenant="b")
    batch = scheduler.schedule()
    assert {entry.seq for entry in batch.seqs} == {behind, other}
    assert list(scheduler.waiting) == [restoring] and restoring.status is SequenceStatus.WAITING
    scheduler.postprocess(batch, [7, 7])
    scheduler.block_manager.restore_landed(restoring.seq_id)
    [entry] = [entry for entry in scheduler.schedule().seqs if entry.seq is restoring]
    assert entry.start == 12 and not scheduler.waiting


def test_an_interactive_request_takes_a_batch_seat_only_once_its_prefix_is_back():
    """Every seat is a running batch request's: an interactive one whose prefix is on the host
    tier starts its restore and preempts nobody until it lands; then it takes a batch seat."""
    scheduler = tiered_scheduler(max_num_seqs=2)
    prompt = list(range(13))
    fill_and_evict(scheduler.block_manager, prompt)
    batch_seqs = [queue(scheduler, [5000 + i, 5100 + i], priority="batch") for i in range(2)]
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [7, 7])
    interactive = queue(scheduler, prompt + [1])
    batch = scheduler.schedule()
    assert {entry.seq for entry in batch.seqs} == set(batch_seqs) and scheduler.num_preemptions == 0
    assert list(scheduler.waiting) == [interactive]
    scheduler.postprocess(batch, [7, 7])
    scheduler.block_manager.restore_landed(interactive.seq_id)
    batch = scheduler.schedule()
    [entry] = [entry for entry in batch.seqs if entry.seq is interactive]
    assert entry.start == 12 and scheduler.num_preemptions == 1 and batch.preempted[0] in batch_seqs


def test_a_restore_leaves_the_reserved_blocks_free():
    bm = BlockManager(8, BLOCK_SIZE, num_host_blocks=16)
    prompt = list(range(25))  # six full blocks
    fill_and_evict(bm, prompt)
    bm.take_pending_copies()
    seq = make_seq(prompt + [1])
    assert bm.start_restore(seq, reserve_blocks=5)
    _, [(_, copies)] = bm.take_pending_copies()
    assert len(copies) == 3 and bm.num_free_blocks == 5


def test_blocks_on_their_way_back_are_matched_by_no_one_until_they_land():
    bm = BlockManager(16, BLOCK_SIZE, num_host_blocks=16)
    prompt = list(range(13))
    fill_and_evict(bm, prompt)
    first, second = make_seq(prompt + [1]), make_seq(prompt + [2])
    assert bm.start_restore(first)
    # The second sequence shares the prefix being copied: it neither reads it nor copies it again.
    assert bm.match_prefix(second) == []
    assert bm.start_restore(second) is True
    _, restores = bm.take_pending_copies()
    assert [seq_id for seq_id, _ in restores] == [first.seq_id]
    bm.restore_landed(first.seq_id)
    assert len(bm.match_prefix(second)) == 3
    assert bm.start_restore(second) is False
