"""The sliding layers' pool (engine.window_blocks) as the block manager keeps it: a long sequence
holds window-many tokens there while its block table keeps them all, prefix hits need the window
blocks before them, forks share them, and everything returns to the pool."""

from __future__ import annotations

from gpuworker.engine.block_manager import BlockManager
from tests.gpuworker.engine.test_block_manager import make_seq

BLOCK_SIZE = 4
WINDOW = 10
# The blocks a sequence may hold between steps: its window's, one it starts mid-block, one more
# for the next token.
HELD = -(-(WINDOW - 1) // BLOCK_SIZE) + 2


def manager(num_window_blocks: int = 64, num_blocks: int = 256) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, window=WINDOW, num_window_blocks=num_window_blocks)


def run_chunks(bm: BlockManager, seq, chunk: int) -> None:
    """Admit seq (with its prefix hit) and compute its tokens `chunk` at a time, as the scheduler does."""
    matched = bm.match_prefix(seq)
    first = min(chunk, seq.num_tokens - len(matched) * BLOCK_SIZE)
    bm.admit(seq, matched, first)
    while True:
        start = seq.num_computed_tokens
        seq.num_computed_tokens += first
        bm.cache_computed_blocks(seq, start)
        left = seq.num_tokens - seq.num_computed_tokens
        if not left:
            return
        first = min(chunk, left)
        assert bm.can_allocate(seq, first)
        bm.allocate(seq, first)


def test_a_long_sequence_holds_only_its_window():
    bm = manager()
    pool = bm.window_pool
    seq = make_seq([7])
    bm.admit(seq, [], 1)
    for token in range(300):  # one token a step, as decoding
        start = seq.num_computed_tokens
        seq.num_computed_tokens += 1
        bm.cache_computed_blocks(seq, start)
        seq.token_ids.append(token)
        if seq.num_computed_tokens >= len(seq.block_table) * BLOCK_SIZE:
            bm.allocate(seq, 1)
        assert pool.blocks_held(seq) <= HELD
        # The live blocks cover the window of the next position.
        assert seq.window_dropped <= pool.first_live_block(seq.num_computed_tokens)
    assert len(seq.block_table) == -(-301 // BLOCK_SIZE)  # the full layers keep everything
    assert pool.num_free_blocks == pool.num_blocks - pool.blocks_held(seq)
    bm.free(seq)
    assert pool.num_free_blocks == pool.num_blocks and seq.window_block_table == []


def test_chunked_prefill_drops_the_blocks_behind_each_chunk():
    bm = manager()
    seq = make_seq(list(range(200)))
    run_chunks(bm, seq, chunk=16)
    # The last chunk's window and the chunk itself.
    assert bm.window_pool.blocks_held(seq) <= -(-(WINDOW - 1 + 16) // BLOCK_SIZE) + 2
    assert seq.window_dropped > 0


def test_prefix_hit_reuses_cached_window_blocks():
    bm = manager()
    first = make_seq(list(range(40)))
    run_chunks(bm, first, chunk=40)
    bm.free(first)
    again = make_seq(list(range(40)) + [99])
    matched = bm.match_prefix(again)
    assert len(matched) == 10
    bm.admit(again, matched, 1)
    pool = bm.window_pool
    live = pool.first_live_block(40)
    assert again.window_dropped == live
    # The window blocks it starts on are the first sequence's, taken back from the cache.
    assert all(pool.ref_counts[b] == 1 for b in again.window_block_table[live:10])


def test_prefix_hit_is_cut_where_window_blocks_were_evicted():
    bm = manager(num_window_blocks=8)
    first = make_seq(list(range(40)))
    run_chunks(bm, first, chunk=4)  # its early window blocks are dropped as it goes
    bm.free(first)
    # A different prompt takes every window block, evicting the first one's.
    other = make_seq([1000 + i for i in range(30)])
    bm.admit(other, [], 30)
    bm.free(other)
    again = make_seq(list(range(40)) + [99])
    # The full layers' blocks are all cached, but a hit needs the window before it: none is left.
    assert bm.match_prefix(again) == []
    assert bm.can_admit([], 16)  # a first chunk, as the scheduler admits it


def test_fork_shares_the_window_blocks_the_child_reads():
    bm = manager()
    parent = make_seq(list(range(40)))
    run_chunks(bm, parent, chunk=40)
    child = make_seq(list(range(40)))
    bm.fork(parent, child)
    pool = bm.window_pool
    assert child.num_computed_tokens == 36
    live = pool.first_live_block(36)
    assert child.window_dropped == live
    assert child.window_block_table[live:] == parent.window_block_table[live:9]
    assert all(pool.ref_counts[b] == 2 for b in child.window_block_table[live:])


def test_fork_after_the_parent_dropped_them_shares_nothing():
    bm = manager()
    parent = make_seq(list(range(40)))
    run_chunks(bm, parent, chunk=4)
    # The parent's next step drops what a child starting at 36 would read.
    parent.token_ids.append(5)
    bm.allocate(parent, 1)
    child = make_seq(list(range(40)))
    bm.fork(parent, child)
    assert child.num_computed_tokens == 0 and child.block_table == [] and child.window_block_table == []


def test_without_a_window_pool_nothing_changes():
    bm = BlockManager(64, BLOCK_SIZE)
    seq = make_seq(list(range(40)))
    run_chunks(bm, seq, chunk=8)
    assert bm.window_pool is None and seq.window_block_table == []
