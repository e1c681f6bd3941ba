"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, ref-counted, with prefix caching.

Each full block that has been computed is registered under a chained hash of its tokens
(hash(parent_hash, tokens)), so a later sequence with the same prefix reuses the blocks instead of
recomputing them. Freed blocks stay cached until the pool needs them, least recently used first.
No torch here: the model runner turns block tables into tensors.

With `num_host_blocks`, cached blocks evicted from the pool spill to a host tier (engine.host_tier),
and a prefix that continues there is copied back before its sequence is admitted (start_restore).

With `window` (a model whose sliding-window layers keep their keys and values in a pool of their
own, engine.window_blocks), every call also keeps the sequence's window table: admitted, grown,
shared, cached and freed together with its block table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from gpuworker.engine.host_tier import HostBlock, HostTier
from gpuworker.engine.sequence import Sequence
from gpuworker.engine.window_blocks import WindowPool

# The parent hash and prefix id of a sequence's first block.
ROOT_HASH = -1
ROOT_PREFIX_ID = 0
# Ends a chain (BlockManager._match_chain) at a block still being copied back from the host tier.
ARRIVING = object()


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def last_block_hash(token_ids: list[int], block_size: int) -> int | None:
    """The chained hash of the last block a prefix-cache match of this text prompt can reach, as
    the block manager hashes it (None: the prompt fills no block). Integer tuples hash alike in
    every process, so a replica's server computes what its engine process caches."""
    parent = None
    for i in range((len(token_ids) - 1) // block_size):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = hash_block_tokens(ROOT_HASH if parent is None else parent, block)
    return parent


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "prefix_id", "parent_prefix_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        # Names the exact token prefix ending with this block (never reused for another prefix).
        # A hash hit is trusted only if both the block's tokens and its parent's prefix id match
        # ours: equal hashes alone could join two different prefixes and serve the wrong KV.
        self.prefix_id: int | None = None
        self.parent_prefix_id: int | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: Callable[[int, tuple[int, ...]], int] = hash_block_tokens,
        window: int | None = None,
        num_window_blocks: int = 0,
        num_host_blocks: int = 0,
    ) -> None:
        """window and num_window_blocks: the sliding layers' window and their pool's size; without
        both, every layer's blocks are this pool's. num_host_blocks: the host tier's slots (0: none)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in eviction order: blocks holding nothing reusable at the front,
        # then cached blocks from least to most recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._next_prefix_id = ROOT_PREFIX_ID + 1
        # Prefix-cache statistics, in tokens, counted at each admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.window_pool = (
            WindowPool(num_window_blocks, block_size, window, enable_prefix_caching)
            if window and num_window_blocks
            else None
        )
        if num_host_blocks and (self.window_pool is not None or not enable_prefix_caching):
            raise ValueError("the host KV tier needs prefix caching and no sliding-window pool")
        self.host_tier = HostTier(num_host_blocks) if num_host_blocks else None
        # Restores in flight by sequence id, and the sequences whose restore landed (not restored
        # again before they are admitted, so a pool too tight to keep them cannot loop).
        self._restoring: dict[int, _Restore] = {}
        self._restored: set[int] = set()
        # GPU blocks whose copies from the host tier are in flight: matched by no one until they land.
        self._arriving: set[int] = set()
        # Restores the runner has still to start: (sequence id, [(host slot, GPU block id)]).
        self.pending_restores: list[tuple[int, list[tuple[int, int]]]] = []
        # Prompt tokens whose blocks came back from the host tier.
        self.host_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by live sequences (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def holds(self, block_hash: int) -> bool:
        """Whether a block of this hash is cached, in the pool or in the host tier."""
        return block_hash in self._cached or (self.host_tier is not None and block_hash in self.host_tier)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the longest prefix of seq's tokens (no side effects).

        At least the last token is left out: its logits are needed, so it must be computed.
        """
        matched: list[int] = self._match_chain(seq, with_host=False)
        if self.window_pool is not None:  # as far as the window blocks it needs are cached too
            matched = matched[: self.window_pool.longest_match(self._prefix_ids(matched))]
        return matched

    def _match_chain(self, seq: Sequence, with_host: bool) -> list:
        """The longest cached prefix of seq's blocks (its last token left out): a GPU block id per
        block, or with_host, the HostBlock of a block found only in the host tier. A block whose
        copy from the host tier is still on its way ends the chain (with_host: as ARRIVING)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, max_blocks)
        chain: list = []
        parent_prefix_id = ROOT_PREFIX_ID
        for i, block_hash in enumerate(hashes):
            tokens = self._tokens(seq, i)
            block_id = self._cached.get(block_hash)
            if block_id in self._arriving:
                if with_host:
                    chain.append(ARRIVING)
                break
            if block_id is not None:
                block = self.blocks[block_id]
                if block.parent_prefix_id == parent_prefix_id and block.token_ids == tokens:
                    chain.append(block_id)
                    parent_prefix_id = block.prefix_id
                    continue
            host_block = self.host_tier.lookup(block_hash, tokens, parent_prefix_id) if with_host else None
            if host_block is None:
                break
            chain.append(host_block)
            parent_prefix_id = host_block.prefix_id
        return chain

    def can_admit(self, matched: list[int], num_new_tokens: int) -> bool:
        num_matched_tokens = len(matched) * self.block_size
        needed = self.num_blocks_for(num_matched_tokens + num_new_tokens) - len(matched)
        # Matched blocks that sit free (cached) leave the free pool when taken.
        revived = sum(1 for block_id in matched if self.blocks[block_id].ref_count == 0)
        if self.window_pool is not None and not self.window_pool.can_admit(
            self._prefix_ids(matched), num_matched_tokens + num_new_tokens
        ):
            return False
        return needed + revived <= len(self._free)

    def admit(self, seq: Sequence, matched: list[int], num_new_tokens: int) -> None:
        """Start seq on the matched cached blocks, then allocate room for num_new_tokens more."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already holds blocks")
        for block_id in matched:
            self._take(block_id)
        if self.window_pool is not None:
            self.window_pool.admit(seq, self._prefix_ids(matched))
        self._restored.discard(seq.seq_id)
        seq.block_table = list(matched)
        seq.num_computed_tokens = len(matched) * self.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_computed_tokens
        self.allocate(seq, num_new_tokens)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if self.window_pool is not None and not self.window_pool.can_allocate(seq, num_new_tokens):
            return False
        return self._num_missing(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold its computed tokens plus num_new_tokens."""
        missing = self._num_missing(seq, num_new_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"{seq} needs {missing} blocks but only {len(self._free)} are free")
        if self.window_pool is not None:
            self.window_pool.allocate(seq, num_new_tokens)
        for _ in range(missing):
            block_id, _ = self._free.popitem(last=False)
            self._evict(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give child the parent's computed full prompt blocks (shared, not copied).

        The prompt's last token is left for the child to compute: it needs its own logits.
        """
        num_shared = min(
            (parent.num_prompt_tokens - 1) // self.block_size, parent.num_computed_tokens // self.block_size
        )
        if child.block_table:
            raise RuntimeError(f"{child} already holds blocks")
        if self.window_pool is not None:
            num_shared = self.window_pool.shareable(parent, num_shared)
            self.window_pool.fork(parent, child, num_shared)
        for block_id in parent.block_table[:num_shared]:
            self._take(block_id)
        child.block_table = parent.block_table[:num_shared]
        child.num_computed_tokens = num_shared * self.block_size
        child.num_cached_tokens = child.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence, num_previously_computed: int) -> None:
        """Register the blocks that became full and computed since num_previously_computed."""
        if not self.enable_prefix_caching:
            return
        first = num_previously_computed // self.block_size
        last = seq.num_computed_tokens // self.block_size
        hashes = self._block_hashes(seq, last)
        for i in range(first, last):
            parent_prefix_id = ROOT_PREFIX_ID if i == 0 else self.blocks[seq.block_table[i - 1]].prefix_id
            block = self.blocks[seq.block_table[i]]
            if parent_prefix_id is None or block.prefix_id is not None:
                continue
            self._register(block, hashes[i], self._tokens(seq, i), parent_prefix_id)
        if self.window_pool is not None:
            self.window_pool.register(seq, first, last, self._prefix_ids(seq.block_table[first:last]))

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; its registered blocks stay cached until evicted."""
        # Tail blocks first, so a prompt's last blocks are evicted before its shared beginning.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if not self._is_reachable(block):
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        if self.window_pool is not None:
            self.window_pool.free(seq)
        self._restored.discard(seq.seq_id)
        if seq.seq_id in self._restoring:  # finished while its blocks come back: they land unused
            self._restoring[seq.seq_id].abandoned = True

    # -- the host tier ----------------------------------------------------------------------------

    @property
    def has_restores_in_flight(self) -> bool:
        return bool(self._restoring)

    def start_restore(self, seq: Sequence, reserve_blocks: int = 0) -> bool:
        """Whether waiting seq must wait for blocks coming back from the host tier. The first call
        for a prefix that continues there holds its GPU blocks, takes free blocks for the host ones
        (leaving reserve_blocks free) and lists their copies (pending_restores); restore_landed
        ends the wait."""
        if self.host_tier is None or seq.seq_id in self._restored:
            return False
        if seq.seq_id in self._restoring:
            return True
        chain = self._match_chain(seq, with_host=True)
        if chain and chain[-1] is ARRIVING:  # another sequence's restore brings part of it: wait
            return True
        # As much of the chain as the free blocks can take (the host blocks and the GPU ones
        # sitting free leave the free pool).
        room = len(self._free) - reserve_blocks
        for end, entry in enumerate(chain):
            room -= isinstance(entry, HostBlock) or self.blocks[entry].ref_count == 0
            if room < 0:
                chain = chain[:end]
                break
        if not any(isinstance(entry, HostBlock) for entry in chain):
            return False
        gpu_hits = [entry for entry in chain if not isinstance(entry, HostBlock)]
        host_hits = [entry for entry in chain if isinstance(entry, HostBlock)]
        # Held first, so that the blocks taken below evict none of them, on either tier.
        for block_id in gpu_hits:
            self._take(block_id)
        for host_block in host_hits:
            self.host_tier.pin(host_block)
        held = [entry if not isinstance(entry, HostBlock) else self._restore_into_free(entry) for entry in chain]
        copies = [(entry.slot, block_id) for entry, block_id in zip(chain, held) if isinstance(entry, HostBlock)]
        self.pending_restores.append((seq.seq_id, copies))
        self._restoring[seq.seq_id] = _Restore(held, host_hits)
        self.host_cache_hits += len(host_hits) * self.block_size
        return True

    def restore_landed(self, seq_id: int) -> None:
        """The copies of seq_id's restore are done: its blocks are cached on the GPU, free to admit."""
        restore = self._restoring.pop(seq_id)
        self._arriving.difference_update(restore.held)
        for host_block in restore.host_blocks:
            self.host_tier.unpin(host_block)
        for block_id in reversed(restore.held):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None  # the most recently used end: evicted last
        if not restore.abandoned:
            self._restored.add(seq_id)

    def take_pending_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, list[tuple[int, int]]]]]:
        """The copies to make before the next step, in this order: spills (GPU block id, host slot),
        then restores (sequence id, [(host slot, GPU block id)])."""
        if self.host_tier is None:
            return [], []
        restores, self.pending_restores = self.pending_restores, []
        return self.host_tier.take_pending_spills(), restores

    def _restore_into_free(self, host_block: HostBlock) -> int:
        """A free block taken to receive host_block's copy, registered as it was (held, ref 1)."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        self._evict(block)
        block.ref_count = 1
        block.block_hash, block.token_ids = host_block.block_hash, host_block.token_ids
        block.prefix_id, block.parent_prefix_id = host_block.prefix_id, host_block.parent_prefix_id
        self._cached[host_block.block_hash] = block_id
        self._arriving.add(block_id)
        return block_id

    def _prefix_ids(self, block_ids: list[int]) -> list[int | None]:
        return [self.blocks[block_id].prefix_id for block_id in block_ids]

    def _register(self, block: Block, block_hash: int, tokens: tuple[int, ...], parent_prefix_id: int) -> None:
        block.block_hash, block.token_ids, block.parent_prefix_id = block_hash, tokens, parent_prefix_id
        holder_id = self._cached.get(block_hash)
        if holder_id is None:
            self._cached[block_hash] = block.block_id
            kept = self.host_tier.lookup(block_hash, tokens, parent_prefix_id) if self.host_tier else None
            if kept is not None:  # computed again while the host tier holds it: the same prefix
                block.prefix_id = kept.prefix_id
                return
        else:
            holder = self.blocks[holder_id]
            if holder.token_ids == tokens and holder.parent_prefix_id == parent_prefix_id:
                # The same prefix computed twice (two sequences in flight at once): same content,
                # same name, so children registered under either are found through the holder.
                block.prefix_id = holder.prefix_id
                return
            # A hash collision: the block gets its own name but is not findable by hash.
        block.prefix_id = self._next_prefix_id
        self._next_prefix_id += 1

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _evict(self, block: Block) -> None:
        if self._is_reachable(block):
            del self._cached[block.block_hash]
            if self.host_tier is not None:
                self.host_tier.spill(
                    block.block_id, block.block_hash, block.token_ids, block.prefix_id, block.parent_prefix_id
                )
        block.reset()

    def _is_reachable(self, block: Block) -> bool:
        return block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id

    def _num_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def _tokens(self, seq: Sequence, block_index: int) -> tuple[int, ...]:
        start = block_index * self.block_size
        tokens = tuple(seq.token_ids[start : start + self.block_size])
        multimodal = seq.group.multimodal
        if multimodal is not None:  # image tokens are keyed by their image too, not by their id alone
            tokens += multimodal.block_keys(start, self.block_size)
        return tokens

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(self.hash_fn(parent, self._tokens(seq, len(hashes))))
        return hashes[:num_blocks]


class _Restore:
    """A restore in flight: the GPU blocks it holds (the chain, in order) and the host blocks it reads."""

    __slots__ = ("held", "host_blocks", "abandoned")

    def __init__(self, held: list[int], host_blocks: list[HostBlock]) -> None:
        self.held = held
        self.host_blocks = host_blocks
        self.abandoned = False
