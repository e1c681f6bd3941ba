"""The host KV tier's memory: one slot per block, and the copies between it and the KV pool.

A slot holds one block of whatever the pool holds, every layer's planes: keys and values, a latent
attention layer's latent + rope plane, FP8 values (their scales are per layer, not per block, so
the bytes alone restore the block). On CUDA the slots are pinned; spills run on the compute stream
(after the steps that wrote the block, before those that reuse it), restores on a stream of their
own, so the copies back overlap the steps that follow; a restore is reported landed once its event
has passed. On CPU every copy is made at once.
"""

from __future__ import annotations

import torch


class HostKVPool:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        """kv_cache: the pool, [layers, planes, blocks, block_size, heads, width]."""
        self.kv_cache = kv_cache
        cuda = kv_cache.device.type == "cuda"
        layers, planes, _, *block_shape = kv_cache.shape
        # Never read before a spill writes it: left unfilled (filling gigabytes of pinned memory
        # would only slow the start).
        self.slots = torch.empty(num_slots, layers, planes, *block_shape, dtype=kv_cache.dtype, pin_memory=cuda)
        self.stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self._in_flight: list[tuple[int, torch.cuda.Event | None]] = []

    @property
    def has_in_flight(self) -> bool:
        return bool(self._in_flight)

    @torch.inference_mode()
    def copy(self, spills: list[tuple[int, int]], restores: list[tuple[int, list[tuple[int, int]]]]) -> None:
        """Enqueue spills (GPU block id, host slot), then restores (sequence id, [(host slot, block id)]);
        a restore may read a slot a spill of this call writes."""
        for block_id, slot in spills:
            self.slots[slot].copy_(self.kv_cache[:, :, block_id], non_blocking=True)
        for seq_id, copies in restores:
            if self.stream is None:
                self._restore(copies)
                self._in_flight.append((seq_id, None))
                continue
            # The target blocks may still be read or written by steps already enqueued.
            self.stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
            with torch.cuda.stream(self.stream):
                self._restore(copies)
                event = torch.cuda.Event()
                event.record(self.stream)
            self._in_flight.append((seq_id, event))

    def landed(self) -> list[int]:
        """The sequence ids whose restores have completed since the last call."""
        landed = [(seq_id, event) for seq_id, event in self._in_flight if event is None or event.query()]
        if landed:
            self._in_flight = [entry for entry in self._in_flight if entry not in landed]
            for _, event in landed:
                if event is not None:  # later steps read the blocks: order them after their copies
                    torch.cuda.current_stream(self.kv_cache.device).wait_event(event)
        return [seq_id for seq_id, _ in landed]

    def wait(self) -> list[int]:
        """Block until every restore in flight has landed; their sequence ids."""
        for _, event in self._in_flight:
            if event is not None:
                event.synchronize()
        return self.landed()

    def _restore(self, copies: list[tuple[int, int]]) -> None:
        for slot, block_id in copies:
            self.kv_cache[:, :, block_id].copy_(self.slots[slot], non_blocking=True)
