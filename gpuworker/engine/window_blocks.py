"""The sliding-window layers' own pool of KV blocks: a sequence holds only the blocks its window
can still read, so a long sequence's sliding layers keep about `window` tokens, not all of them.

A model whose layers mix sliding-window and full attention (Gemma 3) keeps the full layers' keys
and values in BlockManager's pool and the sliding layers' in this one. A sequence's window table
is indexed like its block table (entry i holds positions [i * block_size, (i + 1) * block_size));
before each allocation the blocks wholly before the window of the next position to compute (keys
at positions > p - window for a query at p) leave the sequence: the first `window_dropped` entries
are dead. The attention kernels never read them (they start at each query's window).

Prefix caching: a full block becomes computed together with its window block, which is then
registered under the full block's prefix id (BlockManager's exact name for the token prefix ending
with that block). A prefix hit of k blocks needs the window blocks covering the window before
position k * block_size to be cached too; the hit is cut to the longest k for which they are (the
blocks before that window are not needed). Freed window blocks stay cached until the pool needs
them, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict

from gpuworker.engine.sequence import Sequence


class WindowPool:
    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or window < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and window ({window}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks  # the prefix id a block is cached under
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # full block's prefix id -> window block id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def first_live_block(self, num_computed: int) -> int:
        """The first block a query at position >= num_computed can read."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def blocks_held(self, seq: Sequence) -> int:
        return len(seq.window_block_table) - seq.window_dropped

    # Prefix hits.

    def longest_match(self, prefix_ids: list[int]) -> int:
        """The most of the full pool's matched blocks (their prefix ids, in order) a hit may use:
        k such that the window blocks of [first_live_block(k * block_size), k) are all cached."""
        if not self.enable_prefix_caching:
            return 0
        for k in range(len(prefix_ids), 0, -1):
            first = self.first_live_block(k * self.block_size)
            if all(pid in self._cached for pid in prefix_ids[first:k]):
                return k
        return 0

    def can_admit(self, prefix_ids: list[int], num_tokens: int) -> bool:
        """Whether a sequence starting on the cached window blocks of prefix_ids (a longest_match)
        can hold num_tokens tokens in all."""
        k = len(prefix_ids)
        first = self.first_live_block(k * self.block_size)
        matched = [self._cached[pid] for pid in prefix_ids[first:k]]
        needed = -(-num_tokens // self.block_size) - k
        revived = sum(1 for block in matched if self.ref_counts[block] == 0)
        return needed + revived <= len(self._free)

    def admit(self, seq: Sequence, prefix_ids: list[int]) -> None:
        if seq.window_block_table:
            raise RuntimeError(f"{seq} already holds window blocks")
        k = len(prefix_ids)
        first = self.first_live_block(k * self.block_size)
        for pid in prefix_ids[first:k]:
            self._take(self._cached[pid])
        seq.window_block_table = [0] * first + [self._cached[pid] for pid in prefix_ids[first:k]]
        seq.window_dropped = first

    # Growth, sharing and release.

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._num_missing(seq, num_new_tokens) <= len(self._free) + self._num_droppable(seq)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Drop the blocks before the window of seq's next position, then grow its window table to
        hold its computed tokens plus num_new_tokens."""
        self.drop_passed(seq)
        missing = self._num_missing(seq, num_new_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"{seq} needs {missing} window blocks but only {len(self._free)} are free")
        for _ in range(missing):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            seq.window_block_table.append(block)

    def drop_passed(self, seq: Sequence) -> None:
        """Release the blocks wholly before the window of seq's next position to compute."""
        first = min(self.first_live_block(seq.num_computed_tokens), len(seq.window_block_table))
        for i in range(seq.window_dropped, first):
            self._release(seq.window_block_table[i])
            seq.window_block_table[i] = 0
        seq.window_dropped = max(seq.window_dropped, first)

    def shareable(self, parent: Sequence, num_shared: int) -> int:
        """How many of parent's first blocks a forked child may share: num_shared if the parent
        still holds the window blocks a child starting after them reads, else 0."""
        if num_shared and parent.window_dropped > self.first_live_block(num_shared * self.block_size):
            return 0
        return num_shared

    def fork(self, parent: Sequence, child: Sequence, num_shared: int) -> None:
        if child.window_block_table:
            raise RuntimeError(f"{child} already holds window blocks")
        first = self.first_live_block(num_shared * self.block_size)
        for block in parent.window_block_table[first:num_shared]:
            self._take(block)
        child.window_block_table = [0] * first + parent.window_block_table[first:num_shared]
        child.window_dropped = first

    def register(self, seq: Sequence, first: int, last: int, prefix_ids: list[int | None]) -> None:
        """Cache seq's live window blocks [first, last) under their full blocks' prefix ids."""
        if not self.enable_prefix_caching:
            return
        for i, pid in zip(range(first, last), prefix_ids, strict=True):
            if pid is None or i < seq.window_dropped or pid in self._cached:
                continue
            block = seq.window_block_table[i]
            if self._key[block] is not None:
                continue
            self._key[block] = pid
            self._cached[pid] = block

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.window_block_table[seq.window_dropped :]):
            self._release(block)
        seq.window_block_table = []
        seq.window_dropped = 0

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if self._key[block] is None:  # nothing reusable: first in line to be taken
                self._free.move_to_end(block, last=False)

    def _evict(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            del self._cached[key]
            self._key[block] = None

    def _num_droppable(self, seq: Sequence) -> int:
        """Blocks seq would release on its next allocation that no other sequence holds."""
        first = min(self.first_live_block(seq.num_computed_tokens), len(seq.window_block_table))
        return sum(1 for i in range(seq.window_dropped, first) if self.ref_counts[seq.window_block_table[i]] == 1)

    def _num_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(seq.window_block_table))
