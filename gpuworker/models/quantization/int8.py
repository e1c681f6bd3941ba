"""Int8Linear: INT8 weights with a float32 scale per output channel, activations quantized to INT8
per token at run time, both symmetric (W8A8, compressed-tensors' "int-quantized").

Checkpoint tensors per module: weight int8 [out, in]; weight_scale (float32, bfloat16 or float16)
per channel ([out] or [out, 1]) or per tensor ([] or [1]). A per-tensor scale is repeated over the
channels of its shard, so fused q/k/v and gate/up keep their own scales.
"""

from __future__ import annotations

import torch

from gpuworker.kernels.quant.int8_matmul import (
    INT8_MAX,
    int8_matmul,
    int8_matmul_reference,
    quantize_int8_rows,
)
from gpuworker.models.quantization.linear import QuantizedLinear


class Int8Linear(QuantizedLinear):
    fixed_dtypes = {"weight_int8": torch.int8, "weight_scale": torch.float32}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_int8", torch.empty(self.out_features, self.in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(self.out_features, dtype=torch.float32))

    def expected_fields(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        # A symmetric scheme's zero points are all zero when a quantizer writes them anyway.
        return ("weight", "weight_scale"), ("weight_zero_point",)

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        weights, scales = [], []
        for i, (staged, rows) in enumerate(zip(shards, self.shard_sizes)):
            weight = staged["weight"]
            self._check_shape(i, "weight", weight, (rows, self.in_features))
            if weight.dtype != torch.int8:
                raise ValueError(f"{self.checkpoint_names[i]}.weight has dtype {weight.dtype}, expected torch.int8")
            zero_point = staged.get("weight_zero_point")
            if zero_point is not None and bool(zero_point.ne(0).any()):
                raise ValueError(
                    f"{self.checkpoint_names[i]}.weight_zero_point holds non-zero values: asymmetric INT8 "
                    "weights are not supported"
                )
            weights.append(weight)
            scales.append(self.channel_scale(i, staged["weight_scale"], rows))
        self.weight_int8.copy_(torch.cat(weights))
        self.weight_scale.copy_(torch.cat(scales))

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        weight = torch.empty(self.out_features, self.in_features, device=self.weight_int8.device)
        weight.normal_(0.0, 0.02, generator=generator)
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
        self.weight_int8.copy_(torch.round(weight / scale[:, None]).to(torch.int8))
        self.weight_scale.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = quantize_int8_rows(x)
        matmul = int8_matmul if x.is_cuda else int8_matmul_reference
        return matmul(x_q, x_scale, self.weight_int8, self.weight_scale, bias=self.bias, out_dtype=x.dtype)
