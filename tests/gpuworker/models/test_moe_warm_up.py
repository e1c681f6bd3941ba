"""The MoE layer's warm-up reaches every row tile of the fused kernel, so a first long prompt
compiles nothing (on the GPU each variant costs about a second: a 957 ms first TTFT was measured
for the Qwen3-30B-A3B shape before this warm-up)."""

import pytest
import torch

from gpuworker.kernels.fused_moe import block_m_for
from gpuworker.models.config import MoEConfig
from gpuworker.models.moe import SparseMoE


def _moe(num_experts: int, top_k: int) -> SparseMoE:
    config = MoEConfig(num_experts=num_experts, top_k=top_k, expert_intermediate_size=8, norm_topk_prob=True,
                       shared_expert_intermediate_size=0, sparse_layers=(True,), checkpoint_prefix="mlp",
                       expert_names=("gate_proj", "up_proj", "down_proj"))
    return SparseMoE(16, config)


@pytest.mark.parametrize(("num_experts", "top_k", "expected"), [(128, 8, [1, 128]), (8, 2, [1, 32]), (60, 4, [1, 64])])
def test_warm_up_token_counts_reach_each_row_tile(num_experts, top_k, expected):
    moe = _moe(num_experts, top_k)
    counts = moe.warm_up_token_counts()
    assert counts == expected
    tiles = {block_m_for(t * top_k, num_experts) for t in counts}
    every = {block_m_for(t * top_k, num_experts) for t in range(1, 8193)}
    assert tiles == every  # nothing a batch of up to 8192 tokens takes is left out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_runs_the_fused_kernel_at_each_count():
    moe = _moe(8, 2).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(moe.w13)
    torch.nn.init.normal_(moe.w2)
    moe.warm_up()  # compiles and runs every variant without a collective
