"""Attention kernels: paged decode, causal prefill and bidirectional encoder attention, and the
per-token work around them (rotary embedding, the paged KV cache write)."""
