"""What a tensor-parallel rank knows of its place among the ranks (ParallelContext), which part of a
checkpoint tensor it holds (Shard), and how a row-parallel projection joins the ranks' partial
products; apart from models.tensor_parallel so that the quantized linears, which models.layers
imports, can use them without an import loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one tensor-parallel rank holds: indices [begin, begin + length)
    of dimension `dim` (0: rows, 1: columns), of `size` in the checkpoint."""

    dim: int
    begin: int
    length: int
    size: int


@dataclass(frozen=True)
class ParallelContext:
    """This process's rank among world_size tensor-parallel ranks, their process group (None:
    torch.distributed's default group), and how a MoE layer joins its ranks' experts: True, each
    rank's slice of the tokens dispatched to the experts' ranks and combined back
    (models.expert_parallel); False, every rank on every token and one all-reduce (models.moe).
    EngineConfig.expert_parallel chooses."""

    rank: int
    world_size: int
    group: Any = None
    dispatch_experts: bool = False

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(first, count) of this rank's equal share of `size` items; ValueError if they do not divide."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({self.world_size})")
        count = size // self.world_size
        return self.rank * count, count

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return parts


def join_row_parallel(partial: torch.Tensor, bias: torch.Tensor | None, parallel: ParallelContext) -> torch.Tensor:
    """A row-parallel projection's output from this rank's partial product (its input columns, no
    bias): the partial products summed over the ranks, then the bias, once."""
    out = parallel.all_reduce(partial)
    return out if bias is None else out + bias
