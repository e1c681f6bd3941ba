"""Fp8Linear: FP8 e4m3 weights with a float32 scale per output channel, activations optionally
quantized to FP8 (per token at run time, or with the checkpoint's static per-tensor scale).

Checkpoint tensors per module (compressed-tensors and vLLM's fp8 method name them alike):
weight float8_e4m3fn [out, in]; weight_scale float32, one per tensor ([] or [1]) or per channel
([out] or [out, 1]); input_scale float32 [] or [1] for static activations. A per-tensor scale is
repeated over the channels of its shard, so fused q/k/v keep their own scales; their static input
scales become one (the largest, as vLLM does), since they quantize the same input. With
fp8-at-load the checkpoint's float weight is quantized here, per channel.
"""

from __future__ import annotations

import math

import torch

from gpuworker.kernels.linear.gemv import gemv
from gpuworker.kernels.quant.fp8_matmul import (
    FP8_DTYPE,
    FP8_MAX,
    fp8_matmul,
    fp8_matmul_reference,
    quantize_fp8_rows,
    quantize_fp8_rows_reference,
)
from gpuworker.models.parallel_context import Shard
from gpuworker.models.quantization.linear import QuantizedLinear

# Below this many rows the Triton kernel (a weight stream) beats torch._scaled_mm's tiles.
SCALED_MM_MIN_ROWS = 17


class Fp8Linear(QuantizedLinear):
    fixed_dtypes = {"weight_fp8": FP8_DTYPE, "weight_scale": torch.float32, "input_scale": torch.float32}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_fp8", torch.empty(self.out_features, self.in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale", torch.empty(self.out_features, dtype=torch.float32))
        static = self.quant.activation_scheme == "static"
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32) if static else None)

    def expected_fields(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self.quant.checkpoint_format == "fp8-at-load":
            return ("weight",), ()
        if self.quant.activation_scheme == "static":
            return ("weight", "weight_scale", "input_scale"), ()
        # Dynamic checkpoints may still carry calibration scales; they are not needed.
        return ("weight", "weight_scale"), ("input_scale",)

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        weights, scales, input_scales = [], [], []
        for i, (staged, rows) in enumerate(zip(shards, self.shard_sizes)):
            weight = staged["weight"]
            self._check_shape(i, "weight", weight, (rows, self.in_features))
            if self.quant.checkpoint_format == "fp8-at-load":
                # Per output channel, divided as llm-compressor divides (a one-time cost at load).
                weight, scale = quantize_fp8_rows_reference(weight, exact_division=True)
            else:
                if weight.dtype != FP8_DTYPE:
                    raise ValueError(
                        f"{self.checkpoint_names[i]}.weight has dtype {weight.dtype}, expected {FP8_DTYPE}"
                    )
                scale = self.channel_scale(i, staged["weight_scale"], rows)
            weights.append(weight)
            scales.append(scale)
            if "input_scale" in staged and self.input_scale is not None:
                input_scale = staged["input_scale"]
                if input_scale.numel() != 1:
                    raise ValueError(
                        f"{self.checkpoint_names[i]}.input_scale must hold one value, "
                        f"got shape {tuple(input_scale.shape)}"
                    )
                input_scales.append(input_scale.float().reshape(()))
        self.weight_fp8.copy_(torch.cat(weights))
        self.weight_scale.copy_(torch.cat(scales))
        if self.input_scale is not None:
            self.input_scale.copy_(torch.stack(input_scales).max())

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        weight = torch.empty(self.out_features, self.in_features, device=self.weight_fp8.device)
        weight.normal_(0.0, 0.02, generator=generator)
        q, scale = quantize_fp8_rows(weight)
        self.weight_fp8.copy_(q)
        self.weight_scale.copy_(scale)
        if self.input_scale is not None:
            self.input_scale.fill_(4.0 / FP8_MAX)

    def field_shard(self, field: str, weight_shard: Shard, shape: tuple[int, ...]) -> Shard | None:
        """A rank's rows of the weight take their channels' scales; its columns, every channel's. A
        per-tensor weight scale and the static input scale are whole on every rank."""
        if field == "weight":
            return weight_shard
        per_channel = field == "weight_scale" and math.prod(shape) > 1
        return weight_shard if per_channel and weight_shard.dim == 0 else None

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16):
            # Batch 1 is a weight stream: the GEMV reads the FP8 weight as is and keeps x in its own
            # dtype (no activation quantization: one rounding fewer than the W8A8 GEMM).
            return gemv(x, self.weight_fp8, bias, weight_scale=self.weight_scale)
        if self.quant.activation_scheme is None:
            x_q, x_scale = x, None
        else:
            x_q, x_scale = quantize_fp8_rows(x, self.input_scale)
        if not x.is_cuda:
            return fp8_matmul_reference(
                x_q, self.weight_fp8, self.weight_scale, x_scale=x_scale, bias=bias, out_dtype=x.dtype
            )
        if x_scale is not None and _takes_scaled_mm(x_q, self.weight_fp8, x.dtype):
            return self._scaled_mm(x_q, x_scale, x.dtype, bias)
        return fp8_matmul(x_q, self.weight_fp8, self.weight_scale, x_scale=x_scale, bias=bias, out_dtype=x.dtype)

    def takes_quantized_input(self, x: torch.Tensor) -> bool:
        """Whether the kernel producing x [T, in] may quantize it itself, per token, and hand it to
        forward_quantized (rms_norm_fp8, silu_and_mul_fp8: no bf16 output written and read back by
        quantize_fp8_rows): dynamic activations on the row-wise scaled GEMM's path."""
        return (
            FUSED_INPUT_QUANTIZATION
            and self.row_parallel is None  # forward_quantized is the whole output, not a partial product
            and x.is_cuda
            and x.dim() == 2
            and self.quant.activation_scheme == "dynamic"
            and _takes_scaled_mm(x, self.weight_fp8, x.dtype)
        )

    def forward_quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """forward of an input already quantized per token (float8_e4m3fn [T, in], float32 scale [T]):
        the row-wise scaled FP8 GEMM on the tensor cores (cuBLASLt); bias added after, in out_dtype."""
        return self._scaled_mm(x_q, x_scale, out_dtype, self.bias)

    def _scaled_mm(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
    ) -> torch.Tensor:
        out = torch._scaled_mm(
            x_q, self.weight_fp8.t(), scale_a=x_scale[:, None], scale_b=self.weight_scale[None, :], out_dtype=out_dtype
        )
        return out if bias is None else out + bias


# Whether norms and SiLU-and-mul quantize the input of a dynamic FP8 projection in their own launch
# (Fp8Linear.takes_quantized_input). On the H200 the separate quantizer took 8.6 of a 129.5 ms
# prefill step at 8,192 tokens, besides the bf16 output written and read back; the fused launches
# are not timed on a GPU yet (BENCHMARKS.md lists the run).
FUSED_INPUT_QUANTIZATION = True


def _takes_scaled_mm(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """torch._scaled_mm's row-wise scaling for x [T, in] (or its FP8 values): bfloat16 output,
    dimensions multiples of 16, a GPU with FP8 tensor cores (compute capability 8.9 or later), and
    enough rows to fill its tiles."""
    if not hasattr(torch, "_scaled_mm") or out_dtype != torch.bfloat16 or x.shape[0] < SCALED_MM_MIN_ROWS:
        return False
    if x.shape[1] % 16 or weight.shape[0] % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)
