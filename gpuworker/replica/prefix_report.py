"""Which conversations' KV this replica still holds, for its heartbeat: the gateway names each
request's conversation by a digest (contract.prefix_keys); the replica remembers, per digest, the
hash of the last cacheable block of its latest prompt, and reports the digests whose block is still
cached on either KV tier (the tail of a prompt is evicted first, so a held last block means the
whole history is there)."""

from __future__ import annotations

from collections import OrderedDict

from gpuworker.contract.prefix_keys import MAX_REPORTED_PREFIX_KEYS, is_prefix_key_digest
from gpuworker.engine.block_manager import last_block_hash

# Digests remembered: more than are reported, since some of the remembered are evicted.
REMEMBERED_PREFIX_KEYS = 4 * MAX_REPORTED_PREFIX_KEYS


class HeldPrefixes:
    def __init__(self, capacity: int = REMEMBERED_PREFIX_KEYS) -> None:
        self.capacity = capacity
        self._last_blocks: OrderedDict[str, int] = OrderedDict()  # digest -> block hash, oldest first

    def note(self, digest: str | None, prompt_token_ids: list[int], block_size: int) -> None:
        """A request of conversation `digest` (None or malformed: not named) was admitted."""
        if not is_prefix_key_digest(digest):
            return
        block_hash = last_block_hash(prompt_token_ids, block_size)
        if block_hash is None:
            return
        self._last_blocks[digest] = block_hash
        self._last_blocks.move_to_end(digest)
        while len(self._last_blocks) > self.capacity:
            self._last_blocks.popitem(last=False)

    def block_hashes(self) -> list[int]:
        return list(self._last_blocks.values())

    def report(self, held_block_hashes: list[int]) -> list[str]:
        """The digests whose last block is among held_block_hashes, most recent first, bounded."""
        held = set(held_block_hashes)
        digests = [digest for digest, block_hash in reversed(self._last_blocks.items()) if block_hash in held]
        return digests[:MAX_REPORTED_PREFIX_KEYS]
