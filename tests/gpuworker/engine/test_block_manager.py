"""Block manager: ref counts, prefix caching (with its collision checks) and LRU eviction, torch-free."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpuworker.engine.block_manager import BlockManager
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.sequence import Sequence, SequenceGroup

BLOCK_SIZE = 4
_ids = iter(range(10**9))


def make_seq(tokens: list[int], n: int = 1) -> Sequence:
    group = SequenceGroup(
        f"r{next(_ids)}", tokens, SamplingParams(n=n, max_tokens=8), next(_ids), 8, first_seq_id=next(_ids) * 16
    )
    return group.seqs[0]


def run_prompt(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit seq with its prefix hits, 'compute' the rest of it, register its blocks."""
    matched = bm.match_prefix(seq)
    num_new = seq.num_tokens - len(matched) * bm.block_size
    assert bm.can_admit(matched, num_new)
    bm.admit(seq, matched, num_new)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq, len(matched) * bm.block_size)
    return matched


def test_prefix_hit_shares_full_blocks_only():
    bm = BlockManager(16, BLOCK_SIZE)
    first = make_seq(list(range(10)))  # blocks [0-3] [4-7] and a partial [8, 9]
    run_prompt(bm, first)
    second = make_seq(list(range(9)) + [99])
    matched = run_prompt(bm, second)
    assert matched == first.block_table[:2]
    assert second.num_cached_tokens == 8
    assert [bm.blocks[b].ref_count for b in matched] == [2, 2]
    assert second.block_table[2] != first.block_table[2]
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 20


def test_whole_prompt_is_never_served_from_cache():
    bm = BlockManager(16, BLOCK_SIZE)
    run_prompt(bm, make_seq(list(range(8))))
    again = make_seq(list(range(8)))
    # Both blocks are cached, but the last token must run to produce logits.
    assert len(bm.match_prefix(again)) == 1
    longer = make_seq(list(range(9)))
    assert len(bm.match_prefix(longer)) == 2


def test_different_prefix_same_block_tokens_is_a_miss():
    bm = BlockManager(16, BLOCK_SIZE)
    run_prompt(bm, make_seq([1, 1, 1, 1, 7, 7, 7, 7, 0]))
    assert bm.match_prefix(make_seq([2, 2, 2, 2, 7, 7, 7, 7, 0])) == []


def test_hash_collision_never_serves_other_tokens():
    bm = BlockManager(16, BLOCK_SIZE, hash_fn=lambda parent, tokens: 42)
    first = make_seq([1, 2, 3, 4, 5])
    run_prompt(bm, first)
    assert bm.match_prefix(make_seq([9, 9, 9, 9, 5])) == []
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 6])) == first.block_table[:1]


def test_collision_across_parents_is_caught_by_the_parent_check():
    # A hash that ignores the parent: [c][b] hashes its second block like [a][b].
    bm = BlockManager(16, BLOCK_SIZE, hash_fn=lambda parent, tokens: hash(tokens))
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    run_prompt(bm, make_seq(a + b + [0]))
    y = make_seq(c + b + [0])
    run_prompt(bm, y)
    # [c] is cached (by y) and [b] is cached (after [a]); the KV of that [b] saw [a], not [c].
    z = make_seq(c + b + [0])
    assert bm.match_prefix(z) == y.block_table[:1]


def test_same_prefix_computed_twice_still_chains():
    bm = BlockManager(16, BLOCK_SIZE)
    tokens = list(range(13))
    x, y = make_seq(tokens), make_seq(tokens)
    # Both admitted before either registers: two copies of the same blocks.
    for seq in (x, y):
        bm.admit(seq, [], seq.num_tokens)
    for seq in (x, y):
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq, 0)
    x_blocks, y_blocks = list(x.block_table), list(y.block_table)
    assert bm.match_prefix(make_seq(tokens + [1])) == x_blocks[:3]
    bm.free(x)
    bm.free(y)
    # y's copies are not findable by hash, so they are the first to be reused.
    filler = make_seq([7] * 16)
    bm.admit(filler, [], 16)
    assert set(filler.block_table) == set(y_blocks)
    assert bm.match_prefix(make_seq(tokens + [1])) == x_blocks[:3]


def test_free_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(4, BLOCK_SIZE)
    old, new = make_seq([1] * 5), make_seq([2] * 5)
    run_prompt(bm, old)
    run_prompt(bm, new)
    old_full, new_full = old.block_table[0], new.block_table[0]
    bm.free(old)
    bm.free(new)
    # The partial blocks hold nothing reusable and go first, then old's cached block.
    filler = make_seq([7] * 12)
    bm.admit(filler, [], 12)
    assert old_full in filler.block_table and new_full not in filler.block_table
    assert bm.match_prefix(make_seq([1] * 5)) == []
    assert bm.match_prefix(make_seq([2] * 5)) == [new_full]


def test_hit_on_a_free_cached_block_revives_it():
    bm = BlockManager(3, BLOCK_SIZE)
    first = make_seq([5] * 9)
    run_prompt(bm, first)
    cached = first.block_table[:2]
    bm.free(first)
    assert bm.num_free_blocks == 3
    again = make_seq([5] * 9)
    assert run_prompt(bm, again) == cached
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(again, 4)


def test_can_admit_counts_revived_blocks():
    bm = BlockManager(2, BLOCK_SIZE)
    first = make_seq([5] * 5)
    run_prompt(bm, first)
    bm.free(first)
    seq = make_seq([5] * 4 + [6] * 5)
    matched = bm.match_prefix(seq)
    assert len(matched) == 1
    # 1 revived + 2 new blocks for tokens 4..8 > 2 free.
    assert not bm.can_admit(matched, 5)
    assert bm.can_admit(matched, 4)


def test_fork_shares_prompt_blocks_but_not_the_last_token():
    bm = BlockManager(16, BLOCK_SIZE)
    parent = make_seq(list(range(8)), n=2)
    run_prompt(bm, parent)
    child = parent.group.seqs[1]
    bm.fork(parent, child)
    assert child.block_table == parent.block_table[:1]
    assert child.num_computed_tokens == 4 and child.num_cached_tokens == 4
    assert bm.blocks[parent.block_table[0]].ref_count == 2


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(16, BLOCK_SIZE, enable_prefix_caching=False)
    run_prompt(bm, make_seq(list(range(9))))
    assert bm.match_prefix(make_seq(list(range(9)))) == []


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, decodes, forks and frees over a small pool and a small alphabet (many
    shared prefixes), with a colliding hash. A shadow cache records, for every slot written, the
    whole token prefix its KV was computed from, so a reused block can be checked for exactness."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, BLOCK_SIZE, hash_fn=lambda parent, tokens: sum(tokens) % 5)
        self.live: list[Sequence] = []
        self.shadow: dict[tuple[int, int], tuple[int, ...]] = {}

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        for pos in range(start, end):
            block = seq.block_table[pos // BLOCK_SIZE]
            self.shadow[(block, pos % BLOCK_SIZE)] = tuple(seq.token_ids[: pos + 1])

    def _check_computed(self, seq: Sequence) -> None:
        for pos in range(seq.num_computed_tokens):
            block = seq.block_table[pos // BLOCK_SIZE]
            assert self.shadow[(block, pos % BLOCK_SIZE)] == tuple(seq.token_ids[: pos + 1])

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, tokens):
        seq = make_seq(tokens, n=2)
        matched = self.bm.match_prefix(seq)
        num_new = seq.num_tokens - len(matched) * BLOCK_SIZE
        if not self.bm.can_admit(matched, num_new):
            return
        self.bm.admit(seq, matched, num_new)
        self._check_computed(seq)
        start = seq.num_computed_tokens
        self._write(seq, start, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.bm.cache_computed_blocks(seq, start)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if not self.bm.can_allocate(seq, 1):
            return
        self.bm.allocate(seq, 1)
        start = seq.num_computed_tokens
        self._write(seq, start, start + 1)
        seq.num_computed_tokens += 1
        self.bm.cache_computed_blocks(seq, start)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = Sequence(next(_ids), parent.group, 1)
        self.bm.fork(parent, child)
        self._check_computed(child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)

    @invariant()
    def free_and_used_are_disjoint_and_ref_counts_match_tables(self):
        counts = [0] * self.bm.num_blocks
        for seq in self.live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        free = set(self.bm._free)
        assert len(free) == self.bm.num_free_blocks
        for block in self.bm.blocks:
            assert block.ref_count == counts[block.block_id]
            assert (block.block_id in free) == (block.ref_count == 0)

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(block.ref_count == 0 for block in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_block_manager_properties = BlockManagerMachine.TestCase


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
