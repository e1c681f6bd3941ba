"""Int4Linear: 4-bit weights with a float16 scale and a zero point per group of input rows, in the
one layout kernels.int4_matmul reads (qweight int32 [in / 8, out], zeros uint8 and scales float16
[in / group, out]). AWQ and GPTQ checkpoints are unpacked by their own modules (awq.py, gptq.py)
into plain values, concatenated over fused shards and packed once here.
"""

from __future__ import annotations

import torch

from gpuworker.kernels.quant.int4_matmul import PACK, int4_matmul, int4_matmul_reference, pack_rows
from gpuworker.models.quantization import awq, gptq
from gpuworker.models.quantization.linear import QuantizedLinear

# format -> (required tensors, optional tensors, unpack(shard tensors, in, out, group) -> (q [in, out],
# zeros [in / group, out], scales [in / group, out]))
_FORMATS = {"awq": (awq.FIELDS, (), awq.unpack), "gptq": (gptq.FIELDS, gptq.OPTIONAL_FIELDS, gptq.unpack)}


class Int4Linear(QuantizedLinear):
    fixed_dtypes = {"qweight": torch.int32, "zeros": torch.uint8, "scales": torch.float16}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        group = self.quant.group_size
        if self.in_features % group or group % PACK:
            raise ValueError(
                f"{self.checkpoint_names[0]}: {self.in_features} input features are not whole groups of {group}"
            )
        if any(rows % PACK for rows in self.shard_sizes):
            raise ValueError(
                f"{self.checkpoint_names[0]}: output features {self.shard_sizes} must be multiples of {PACK}"
            )
        groups = self.in_features // group
        self.register_buffer("qweight", torch.empty(self.in_features // PACK, self.out_features, dtype=torch.int32))
        self.register_buffer("zeros", torch.empty(groups, self.out_features, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(groups, self.out_features, dtype=torch.float16))

    def expected_fields(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        required, optional, _ = _FORMATS[self.quant.checkpoint_format]
        return required, optional

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        unpack = _FORMATS[self.quant.checkpoint_format][2]
        values, zeros, scales = [], [], []
        for i, (staged, rows) in enumerate(zip(shards, self.shard_sizes)):
            try:
                q, z, s = unpack(staged, self.in_features, rows, self.quant.group_size)
            except ValueError as exc:
                raise ValueError(f"{self.checkpoint_names[i]}: {exc}") from exc
            values.append(q)
            zeros.append(z)
            scales.append(s)
        self.qweight.copy_(pack_rows(torch.cat(values, dim=1)))
        self.zeros.copy_(torch.cat(zeros, dim=1))
        self.scales.copy_(torch.cat(scales, dim=1))

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        info = torch.iinfo(torch.int32)
        self.qweight.random_(info.min, info.max, generator=generator)
        self.zeros.fill_(8)
        self.scales.fill_(0.02 / 4)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        group = self.quant.group_size
        if x.is_cuda:
            return int4_matmul(x, self.qweight, self.zeros, self.scales, group, bias)
        return int4_matmul_reference(x, self.qweight, self.zeros, self.scales, group, bias)
