"""BlockFp8Linear: FP8 e4m3 weights with a float32 scale per block of weight_block_size (DeepSeek's
layout), activations quantized at run time per token and group of block columns.

Checkpoint tensors per module: weight float8_e4m3fn [out, in]; weight_scale_inv float32
[ceil(out / rows), ceil(in / columns)] for weight_block_size [rows, columns], the factor that
multiplies each block back. The weight stays FP8 in memory with its block scales. Fused projections
(q, k, v; gate, up) concatenate their shards' scale rows when every shard but the last ends on a block
boundary; otherwise each output row keeps its own copy of its block's scales (group_n 1), so the GEMM
reads the right scale whatever the shard sizes. Split over tensor-parallel ranks, a projection takes
whole blocks: its rows (or input columns) of the weight and the same blocks' rows (or columns) of
weight_scale_inv; a row-parallel one adds its bias after the ranks' partial products are summed.
"""

from __future__ import annotations

import torch

from gpuworker.kernels.quant.block_fp8_matmul import (
    block_fp8_matmul,
    block_fp8_matmul_reference,
    check_fp8_device,
    quantize_fp8_groups,
)
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE, FP8_MAX
from gpuworker.models.parallel_context import Shard
from gpuworker.models.quantization.linear import QuantizedLinear


class BlockFp8Linear(QuantizedLinear):
    fixed_dtypes = {"weight_fp8": FP8_DTYPE, "weight_scale_inv": torch.float32}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.block_rows, self.group_k = self.quant.weight_block_size
        aligned = all(rows % self.block_rows == 0 for rows in self.shard_sizes[:-1])
        # Output rows per scale row in the fused layout.
        self.group_n = self.block_rows if aligned else 1
        scale_shape = (-(-self.out_features // self.group_n), -(-self.in_features // self.group_k))
        self.register_buffer("weight_fp8", torch.empty(self.out_features, self.in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale_inv", torch.empty(scale_shape, dtype=torch.float32))

    def expected_fields(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("weight", "weight_scale_inv"), ()

    def field_shard(self, field: str, weight_shard: Shard, shape: tuple[int, ...]) -> Shard | None:
        if field == "weight":
            return weight_shard
        block = self.quant.weight_block_size[weight_shard.dim]
        if weight_shard.begin % block or weight_shard.length % block:
            raise ValueError(
                f"quantization: {', '.join(self.checkpoint_names)}: a rank's {weight_shard.length} "
                f"{'rows' if weight_shard.dim == 0 else 'columns'} from {weight_shard.begin} are not whole "
                f"blocks of weight_block_size {list(self.quant.weight_block_size)}"
            )
        size = -(-weight_shard.size // block)
        return Shard(weight_shard.dim, weight_shard.begin // block, weight_shard.length // block, size)

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        check_fp8_device(self.weight_fp8.device)
        weights, scales = [], []
        column_blocks = -(-self.in_features // self.group_k)
        for i, (staged, rows) in enumerate(zip(shards, self.shard_sizes)):
            weight, scale = staged["weight"], staged["weight_scale_inv"]
            self._check_shape(i, "weight", weight, (rows, self.in_features))
            if weight.dtype != FP8_DTYPE:
                raise ValueError(f"{self.checkpoint_names[i]}.weight has dtype {weight.dtype}, expected {FP8_DTYPE}")
            self._check_shape(i, "weight_scale_inv", scale, (-(-rows // self.block_rows), column_blocks))
            if not scale.dtype.is_floating_point:
                raise ValueError(
                    f"{self.checkpoint_names[i]}.weight_scale_inv has dtype {scale.dtype}, expected torch.float32"
                )
            scale = scale.float()
            if self.group_n == 1:
                scale = scale.repeat_interleave(self.block_rows, dim=0)[:rows]
            weights.append(weight)
            scales.append(scale)
        self.weight_fp8.copy_(torch.cat(weights))
        self.weight_scale_inv.copy_(torch.cat(scales))

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        values = torch.empty(self.weight_fp8.shape, device=self.weight_fp8.device)
        values.normal_(0.0, FP8_MAX / 8, generator=generator)
        self.weight_fp8.copy_(values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
        self.weight_scale_inv.fill_(0.02 * 8 / FP8_MAX)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        x_q, x_scale = quantize_fp8_groups(x, self.group_k)
        matmul = block_fp8_matmul if x.is_cuda else block_fp8_matmul_reference
        out = matmul(
            x_q,
            x_scale,
            self.weight_fp8,
            self.weight_scale_inv,
            self.group_n,
            self.group_k,
            bias=bias,
            out_dtype=x.dtype,
        )
        return out.reshape(*shape[:-1], self.out_features)


class DequantizedBlockFp8Linear(BlockFp8Linear):
    """A block FP8 projection widened to the model dtype as it loads: DeepSeek's kv_b_proj.

    Multi-head latent attention does not run kv_b_proj as one GEMM in decode: its key rows (W_UK)
    multiply each head's query and its value rows (W_UV) each head's latent output, per head
    (models.deepseek.attention), products the block FP8 GEMM (one activation scale per token and
    group of columns) does not express. It is small (num_heads * (qk_nope + v) x kv_lora_rank), so
    its weight is dequantised once at load and the absorbed decode and the prefill expansion read it
    in the model dtype, with unrounded inputs (as vLLM's latent attention does).
    """

    fixed_dtypes = {}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        del self.weight_fp8, self.weight_scale_inv
        self.register_buffer("weight_dense", torch.empty(self.out_features, self.in_features))

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_dense

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        rows, columns = self.quant.weight_block_size
        dense = []
        for i, (staged, out_rows) in enumerate(zip(shards, self.shard_sizes)):
            weight, scale = staged["weight"], staged["weight_scale_inv"]
            self._check_shape(i, "weight", weight, (out_rows, self.in_features))
            if weight.dtype != FP8_DTYPE:
                raise ValueError(f"{self.checkpoint_names[i]}.weight has dtype {weight.dtype}, expected {FP8_DTYPE}")
            blocks = (-(-out_rows // rows), -(-self.in_features // columns))
            self._check_shape(i, "weight_scale_inv", scale, blocks)
            scale = scale.float().repeat_interleave(rows, dim=0)[:out_rows].repeat_interleave(columns, dim=1)
            dense.append(weight.float() * scale[:, : self.in_features])
        self.weight_dense.copy_(torch.cat(dense))

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        self.weight_dense.normal_(0.0, 0.02, generator=generator)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight_dense, bias)
