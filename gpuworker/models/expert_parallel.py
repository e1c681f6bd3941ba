"""Expert parallelism by dispatch and combine (DeepSeek-style): a MoE layer's experts are split over
the ranks, and each (token, expert) choice travels to the rank that holds the expert and back.

Under tensor parallelism every rank holds the same activations (the all-reduces before the MoE make
them whole), so the MoE first splits the tokens: rank r routes only its slice of ceil(T / N) tokens,
sends each of its (token, expert, weight) choices to the expert's rank (all_to_all_single, the
counts exchanged first), computes the choices it receives with its own experts, sends the weighted
results back to the tokens' rank, and sums each token's top_k results there in expert order. The
slices are then all-gathered (or, with a shared expert split like a dense MLP, placed into its
partial output and all-reduced), so the layer's output is whole on every rank again. gloo (CPU)
and NCCL (CUDA) both implement all_to_all_single with uneven splits.

The counts are read on the host (the splits of the exchange), so this mode runs eagerly: a split
model takes no CUDA graphs (engine.model_runner).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gpuworker.models.tensor_parallel import ParallelContext

# experts(x [n, H], weights [n, 1] float32, ids [n, 1] int64 global) -> [n, H] weighted outputs
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def token_slice(num_tokens: int, parallel: ParallelContext) -> tuple[int, int, int]:
    """(first token, tokens, rows per rank) of this rank's slice of num_tokens replicated tokens:
    ceil(T / N) rows each, the last slices shorter (or empty) so the gather pads them."""
    rows = -(-num_tokens // parallel.world_size)
    first = min(parallel.rank * rows, num_tokens)
    return first, min(rows, num_tokens - first), rows


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: ExpertsFn,
    experts_per_rank: int,
    parallel: ParallelContext,
) -> torch.Tensor:
    """x [t, H] this rank's tokens with their routing weights and global expert ids [t, top_k] ->
    [t, H]: each token's weighted sum over its top_k experts, wherever they are held. Every rank
    calls this in step (its t may be 0)."""
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    # Sorted by expert: the choices for each rank are one run, and each token's results come back
    # in expert order, the order in which the unsplit layer adds them.
    order = torch.argsort(flat_ids, stable=True)
    send_counts = torch.bincount(flat_ids // experts_per_rank, minlength=parallel.world_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=parallel.group)
    sent, received = send_counts.tolist(), recv_counts.tolist()
    token_of_choice = order // top_k
    rows = _exchange(x[token_of_choice], received, sent, parallel)
    # (id, weight) in one float64 tensor: both exact (ids < 2**53; weights are float32).
    choice = torch.stack([flat_ids[order].double(), weights.reshape(-1)[order].double()], dim=1)
    choice = _exchange(choice, received, sent, parallel)
    results = experts(rows, choice[:, 1:].float().contiguous(), choice[:, :1].long().contiguous())
    results = _exchange(results, sent, received, parallel)
    out = torch.zeros(num_tokens, x.shape[1], dtype=results.dtype, device=x.device)
    return out.index_add_(0, token_of_choice, results)


def gather_tokens(local: torch.Tensor, num_tokens: int, parallel: ParallelContext) -> torch.Tensor:
    """Every rank's slice (token_slice) of [T, H] put together, on every rank."""
    _, held, rows = token_slice(num_tokens, parallel)
    padded = local.new_zeros(rows, local.shape[1])
    padded[:held] = local
    return torch.cat(parallel.all_gather(padded))[:num_tokens]


def _exchange(tensor: torch.Tensor, recv_rows: list[int], send_rows: list[int], parallel: ParallelContext):
    """Rows [sum(send_rows), ...] sent in runs to ranks 0..N-1 -> the runs they send here."""
    out = tensor.new_empty(sum(recv_rows), *tensor.shape[1:])
    dist.all_to_all_single(out, tensor.contiguous(), recv_rows, send_rows, group=parallel.group)
    return out
