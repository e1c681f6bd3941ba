"""Prompt scoring: the log-probability the model gives each token of a text after the tokens before
it, with the engine's own loaded model, kernels and attention (what perplexity is measured with).

One sequence is run as one prefill over a scratch KV cache of its own (so the engine's block pool,
and the prefix cache in it, is left untouched); the logits of every position are taken in slices,
never a [tokens, vocab] float32 tensor for a whole long window at once.
"""

from __future__ import annotations

import torch

from gpuworker.attention.backend import AttentionMetadata

# Rows of logits made at a time: [rows, vocab] float32 (128 MB at a 128k vocabulary).
LOGIT_ROWS = 256


@torch.inference_mode()
def token_logprobs(runner, token_ids: list[int]) -> torch.Tensor:
    """log p(token_ids[i] | token_ids[:i]) for i = 1 .. n - 1, float64 [n - 1] on the host.

    runner: the engine's ModelRunner (its model, device and block size). A model split over ranks
    or with a pool of its own for sliding-window layers is refused with a ValueError."""
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"scoring needs at least 2 tokens, got {n}")
    if runner.workers is not None:
        raise ValueError("prompt scoring runs on one GPU: this engine is split over tensor-parallel ranks")
    if runner.window_cache is not None:
        raise ValueError("prompt scoring does not support a separate sliding-window KV pool")
    device, block_size = runner.device, runner.block_size
    num_blocks = -(-n // block_size)
    # The engine's pool layout, [layers, planes, blocks, block_size, heads, width], with this text's blocks only.
    shape = (*runner.kv_cache.shape[:2], num_blocks, *runner.kv_cache.shape[3:])
    scratch = torch.zeros(shape, dtype=runner.kv_cache.dtype, device=device)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    positions = torch.arange(n, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        num_decode_seqs=0,
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    model = runner.model
    hidden = model(ids, positions, list(scratch.unbind(0)), meta)
    out = torch.empty(n - 1, dtype=torch.float64)
    for start in range(0, n - 1, LOGIT_ROWS):
        stop = min(start + LOGIT_ROWS, n - 1)
        logits = model.compute_logits(hidden[start:stop]).float()
        chosen = torch.log_softmax(logits, dim=-1).gather(1, ids[start + 1 : stop + 1, None])[:, 0]
        out[start:stop] = chosen.double().cpu()
    return out
