"""A benchmark's long context without its prefill: random keys and values written straight into
KV blocks and registered in the prefix cache under a prompt's tokens, as if a prefill had computed
them. A request for that prompt then starts on those blocks and prefills only its last tokens.

Decode speed does not depend on the cached values, so this measures decode at a context whose
prefill would take minutes; the tokens it produces are meaningless. Needs prefix caching and one
rank's standard [2, blocks, block_size, heads, head_dim] layers (no window pool, no latent cache).
"""

from __future__ import annotations

import torch

from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.sequence import SequenceGroup

# Blocks written per copy, to bound the random temporaries on the device.
BLOCKS_PER_WRITE = 4096


def fill_prefix_cache(engine, token_ids: list[int], *, seed: int = 0) -> list[int]:
    """Fill the KV blocks of token_ids' full blocks, all but the last token (which a request must
    compute for its logits), with random values and register them in the prefix cache. Returns the
    block ids filled; a request for token_ids submitted before any other work takes them over."""
    _check_fillable(engine)
    block_manager = engine.scheduler.block_manager
    num_filled = (len(token_ids) - 1) // block_manager.block_size * block_manager.block_size
    if num_filled == 0:
        raise ValueError(f"token_ids ({len(token_ids)}) must be longer than one block ({block_manager.block_size})")
    params = SamplingParams(max_tokens=1)
    holder = SequenceGroup("fill-prefix-cache", token_ids, params, -1, 1, first_seq_id=-1).seqs[0]
    if not block_manager.can_admit([], num_filled):
        raise ValueError(
            f"{num_filled} tokens need {block_manager.num_blocks_for(num_filled)} KV blocks, "
            f"the pool has {block_manager.num_free_blocks} free"
        )
    block_manager.admit(holder, [], num_filled)
    blocks = list(holder.block_table)
    _write_random_blocks(engine.runner.kv_caches, blocks, seed)
    holder.num_computed_tokens = num_filled
    block_manager.cache_computed_blocks(holder, 0)
    block_manager.free(holder)
    return blocks


def _check_fillable(engine) -> None:
    config = engine.config
    if not config.enable_prefix_caching:
        raise ValueError("filling the cache needs enable_prefix_caching")
    if engine.workers is not None:
        raise ValueError("filling the cache supports one rank (tensor_parallel_size 1)")
    if config.window_pool is not None or engine.model_config.mla is not None:
        raise ValueError("filling the cache supports models whose layers all cache keys and values in one pool")
    if engine.has_unfinished_requests():
        raise ValueError("fill the cache before submitting requests")


@torch.inference_mode()
def _write_random_blocks(kv_caches: list[torch.Tensor], blocks: list[int], seed: int) -> None:
    """Standard-normal keys and values (cast to the cache dtype; an FP8 cache's unit scales keep
    them in range) in every layer's `blocks`."""
    generator = None
    for layer in kv_caches:
        if generator is None:
            generator = torch.Generator(device=layer.device).manual_seed(seed)
        for start in range(0, len(blocks), BLOCKS_PER_WRITE):
            ids = torch.tensor(blocks[start : start + BLOCKS_PER_WRITE], dtype=torch.int64, device=layer.device)
            shape = (layer.shape[0], len(ids), *layer.shape[2:])
            values = torch.randn(shape, generator=generator, device=layer.device, dtype=torch.float32)
            values = values.to(layer.dtype)
            if layer.dtype.itemsize == 1:  # index_copy_ has no float8 kernels: copy the bytes
                layer.view(torch.uint8).index_copy_(1, ids, values.view(torch.uint8))
            else:
                layer.index_copy_(1, ids, values)
