"""QuantizedLinear: what the FP8 and INT4 linears share with the loader.

A quantized projection may stand for several checkpoint modules fused along its output (q, k and v;
gate and up), each stored as its own group of tensors (weight and scales, or qweight, qzeros and
scales). The loader hands each tensor to load_shard; finish() checks that every shard is complete
and converts them into the layout the kernels read. Biases stay ordinary parameters, loaded by the
dense path as row ranges of `bias`. A tensor-parallel rank's projection holds its shard of each
checkpoint module (checkpoint_shards, set by the loader), and reads only that part of each tensor
(field_shard says which part of a scale goes with the weight's).
"""

from __future__ import annotations

import torch
from torch import nn

from gpuworker.checkpoint_quantization import QuantConfig
from gpuworker.models.parallel_context import ParallelContext, Shard, join_row_parallel


class FixedDtypes(nn.Module):
    """A module whose buffers named in fixed_dtypes keep their dtype when the model is cast to the
    activation dtype (model.to): FP8 values and float32 scales. Every FP8 value is a bfloat16 and a
    float16 value, so a cast there and back loses nothing."""

    fixed_dtypes: dict[str, torch.dtype] = {}

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, dtype in self.fixed_dtypes.items():
            buffer = getattr(self, name)
            if buffer is not None and buffer.dtype != dtype:
                setattr(self, name, buffer.to(dtype))
        return self


class QuantizedLinear(FixedDtypes):
    # No dense weight: loader.checkpoint_targets skips a None weight, and the quantized tensors
    # arrive through load_shard instead.
    weight = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quant: QuantConfig,
        checkpoint_names: tuple[str, ...],
        shard_sizes: tuple[int, ...],
    ) -> None:
        super().__init__()
        if sum(shard_sizes) != out_features or len(shard_sizes) != len(checkpoint_names):
            raise ValueError(f"shards {shard_sizes} of {checkpoint_names} do not make {out_features} outputs")
        self.in_features = in_features
        self.out_features = out_features
        self.quant = quant
        self.checkpoint_names = checkpoint_names
        self.shard_sizes = shard_sizes
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._staged: list[dict[str, torch.Tensor]] = [{} for _ in checkpoint_names]
        # This rank's part of each checkpoint module's weight (None: all of it).
        self.checkpoint_shards: list[Shard | None] = [None] * len(checkpoint_names)
        # Set on a row-parallel projection (o_proj, down_proj of a split model): the ranks' partial
        # products are summed (tensor_parallel.join_row_parallel) before the bias is added.
        self.row_parallel: ParallelContext | None = None

    def channel_scale(self, shard: int, scale: torch.Tensor, rows: int) -> torch.Tensor:
        """Shard `shard`'s weight_scale as one float32 scale per output row: a per-tensor scale
        repeated, or a per-channel one of shape (rows,) or (rows, 1); ValueError naming the tensor."""
        scale = scale.float()
        if scale.numel() == 1:
            return scale.reshape(1).expand(rows)
        if tuple(scale.shape) in ((rows,), (rows, 1)):
            return scale.reshape(rows)
        raise ValueError(
            f"{self.checkpoint_names[shard]}.weight_scale has shape {tuple(scale.shape)}, expected "
            f"one value (per tensor) or ({rows}, 1) (per channel)"
        )

    def expected_fields(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(required, optional) tensor names under each checkpoint module."""
        raise NotImplementedError

    def required_names(self) -> list[str]:
        """The checkpoint tensors this module cannot load without."""
        required, _ = self.expected_fields()
        return [f"{name}.{field}" for name in self.checkpoint_names for field in required]

    def check_field(self, shard: int, field: str) -> None:
        required, optional = self.expected_fields()
        if field not in required and field not in optional:
            raise ValueError(
                f"{self.checkpoint_names[shard]}.{field}: unexpected tensor for "
                f"{self.quant.checkpoint_format} (expected {', '.join(required + optional)})"
            )

    def field_shard(self, field: str, weight_shard: Shard, shape: tuple[int, ...]) -> Shard | None:
        """The part of tensor `field` (of `shape` in the checkpoint) that goes with `weight_shard` of
        the weight, None for all of it; ValueError where the format's scales do not split there
        (models.tensor_parallel.shard_config refuses those models before they load)."""
        raise ValueError(f"quantization: {self.quant.checkpoint_format} projections are not split over ranks")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_parallel is None:
            return self.project(x, self.bias)
        return join_row_parallel(self.project(x, None), self.bias, self.row_parallel)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] times this rank's weight, plus `bias` when given -> [..., out]."""
        raise NotImplementedError

    def load_shard(self, shard: int, field: str, tensor: torch.Tensor) -> None:
        self.check_field(shard, field)
        self._staged[shard][field] = tensor

    @torch.no_grad()
    def finish(self) -> None:
        """Convert the staged shards into this module's buffers; a ValueError names what is missing."""
        staged = {f"{name}.{field}" for name, fields in zip(self.checkpoint_names, self._staged) for field in fields}
        missing = [name for name in self.required_names() if name not in staged]
        if missing:
            raise ValueError(
                f"{len(missing)} quantized tensor(s) missing: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )
        device = next(iter(self.buffers())).device
        # Converted on the model's device: unpacking or quantizing an 8B model on the host is slow.
        self._build([{field: t.to(device) for field, t in staged.items()} for staged in self._staged])
        self._staged = [{} for _ in self.checkpoint_names]

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def fill_dummy(self, generator: torch.Generator) -> None:
        """Random values of the right dtypes, for load_format "dummy" (benchmarks)."""
        raise NotImplementedError

    def _check_shape(self, shard: int, field: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.checkpoint_names[shard]}.{field} has shape {tuple(tensor.shape)}, expected {shape}"
            )
