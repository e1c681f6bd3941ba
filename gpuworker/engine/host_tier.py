"""The second KV tier's bookkeeping: a bounded pool of host-memory slots holding blocks evicted from
the GPU prefix cache, found by the same chained block hash, evicted least recently used first.

A slot keeps the block's identity (hash, tokens, prefix ids; block_manager.Block), so a block
restored from it joins the GPU prefix cache exactly as it left, and children cached under it on
either tier still match. The tier is inclusive: a restored block keeps its host copy, so evicting it
again costs no copy. The bytes live in the model runner (engine.host_kv_pool); this module only
decides which slot holds what and lists the copies to make. No torch here.
"""

from __future__ import annotations

from collections import OrderedDict


class HostBlock:
    __slots__ = ("slot", "block_hash", "token_ids", "prefix_id", "parent_prefix_id", "pins")

    def __init__(
        self, slot: int, block_hash: int, token_ids: tuple[int, ...], prefix_id: int, parent_prefix_id: int
    ) -> None:
        self.slot = slot
        self.block_hash = block_hash
        self.token_ids = token_ids
        self.prefix_id = prefix_id
        self.parent_prefix_id = parent_prefix_id
        # Restores reading this slot now: a pinned slot is never handed to another block.
        self.pins = 0


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # By block hash, least recently used first.
        self._blocks: OrderedDict[int, HostBlock] = OrderedDict()
        # Copies the runner has still to make, in order: (GPU block id, host slot) each.
        self.pending_spills: list[tuple[int, int]] = []
        # Counters: blocks copied out, blocks copied back, blocks dropped for room.
        self.num_spilled = 0
        self.num_restored = 0
        self.num_evicted = 0

    @property
    def num_used_slots(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_prefix_id: int) -> HostBlock | None:
        """The host block holding exactly this prefix's block (same tokens under the same parent)."""
        block = self._blocks.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_prefix_id != parent_prefix_id:
            return None
        return block

    def spill(
        self, block_id: int, block_hash: int, token_ids: tuple[int, ...], prefix_id: int, parent_prefix_id: int
    ) -> None:
        """Keep a block leaving the GPU: a copy is listed unless the tier holds it already. With
        every slot pinned the block is dropped (recomputed when next needed)."""
        held = self._blocks.get(block_hash)
        if held is not None:
            if held.token_ids == token_ids and held.parent_prefix_id == parent_prefix_id:
                self._blocks.move_to_end(block_hash)
                return
            if held.pins:
                return  # a colliding hash whose slot is being read: keep the one being read
            self._drop(held)
        slot = self._take_slot()
        if slot is None:
            return
        self._blocks[block_hash] = HostBlock(slot, block_hash, token_ids, prefix_id, parent_prefix_id)
        self.pending_spills.append((block_id, slot))
        self.num_spilled += 1

    def pin(self, block: HostBlock) -> None:
        block.pins += 1
        self._blocks.move_to_end(block.block_hash)
        self.num_restored += 1

    def unpin(self, block: HostBlock) -> None:
        block.pins -= 1

    def take_pending_spills(self) -> list[tuple[int, int]]:
        spills, self.pending_spills = self.pending_spills, []
        return spills

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block in self._blocks.values():  # least recently used first
            if not block.pins:
                self._drop(block)
                self.num_evicted += 1
                return self._free_slots.pop()
        return None

    def _drop(self, block: HostBlock) -> None:
        del self._blocks[block.block_hash]
        # A spill into this slot still pending is harmless: the slot's next owner's spill is listed
        # after it, and restores read a slot only after every listed spill was made.
        self._free_slots.append(block.slot)
