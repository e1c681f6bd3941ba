"""BlockFp8Experts: a SparseMoE's routed experts in block-wise FP8 (DeepSeek's routed experts, Qwen3-MoE's
FP8 checkpoints), kept in e4m3 with their block scales and run by kernels.moe.block_fp8.

Stacked expert-major as SparseMoE stacks its float experts, so the loader fills them as row ranges:
w13 [E * 2I, H] (each expert's gate rows, then its up rows) with w13_scale [E * 2 * ceil(I / rows),
ceil(H / columns)] (gate's block rows, then up's), w2 [E * H, I] with w2_scale [E * ceil(H / rows),
ceil(I / columns)], for weight_block_size [rows, columns]. Buffers, not parameters: load_format "dummy"
draws parameters from a normal distribution, which e4m3 tensors do not take (fill_dummy instead).
"""

from __future__ import annotations

import torch

from gpuworker.kernels.moe.block_fp8 import experts_block_fp8_reference, fused_moe_block_fp8
from gpuworker.kernels.quant.block_fp8_matmul import check_fp8_device
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE, FP8_MAX
from gpuworker.models.quantization.linear import FixedDtypes


class BlockFp8Experts(FixedDtypes):
    fixed_dtypes = {"w13": FP8_DTYPE, "w2": FP8_DTYPE, "w13_scale": torch.float32, "w2_scale": torch.float32}

    def __init__(self, num_experts: int, hidden_size: int, inter: int, block: tuple[int, int]) -> None:
        super().__init__()
        rows, cols = block
        self.block = block
        self.num_experts, self.hidden_size, self.inter = num_experts, hidden_size, inter
        # Scale rows per expert: gate's and up's blocks (each ceil(I / rows)), and down's.
        self.inter_blocks, self.hidden_blocks = -(-inter // rows), -(-hidden_size // rows)
        e = num_experts
        self.register_buffer("w13", torch.empty(e * 2 * inter, hidden_size, dtype=FP8_DTYPE))
        self.register_buffer("w2", torch.empty(e * hidden_size, inter, dtype=FP8_DTYPE))
        self.register_buffer("w13_scale", torch.empty(e * 2 * self.inter_blocks, -(-hidden_size // cols)))
        self.register_buffer("w2_scale", torch.empty(e * self.hidden_blocks, -(-inter // cols)))

    def operands(self) -> tuple[torch.Tensor, ...]:
        """(w13, w13_scale, w2, w2_scale) with an expert dimension, as kernels.moe.block_fp8 takes them."""
        e = self.num_experts
        return (
            self.w13.view(e, 2 * self.inter, self.hidden_size),
            self.w13_scale.view(e, 2 * self.inter_blocks, -1),
            self.w2.view(e, self.hidden_size, self.inter),
            self.w2_scale.view(e, self.hidden_blocks, -1),
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first_expert: int) -> torch.Tensor:
        """x [T, H]; routing weights and global expert ids [T, top_k] -> [T, H]: these experts' part."""
        experts = fused_moe_block_fp8 if x.is_cuda else experts_block_fp8_reference
        return experts(x, *self.operands(), weights, ids, self.block, first_expert)

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        """Random values of the right dtypes, for load_format "dummy" (benchmarks)."""
        check_fp8_device(self.w13.device)
        for values, scale, fan_in in (
            (self.w13, self.w13_scale, self.hidden_size),
            (self.w2, self.w2_scale, self.inter),
        ):
            draw = torch.empty(values.shape, device=values.device).normal_(0.0, FP8_MAX / 8, generator=generator)
            values.copy_(draw.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
            scale.fill_(8 / (FP8_MAX * fan_in**0.5))
