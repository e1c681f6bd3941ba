"""The MoE layer's warm-up reaches every variant of its kernels (the decode path's configs, the
grouped kernel's row tiles), so a first long prompt compiles nothing (on the GPU each variant
costs about a second: a 957 ms first TTFT was measured for the Qwen3-30B-A3B shape before this
warm-up)."""

import pytest
import torch

from gpuworker.kernels.moe.decode import ENV_OVERRIDE, TABLE_KEY
from gpuworker.models.config import MoEConfig
from gpuworker.models.moe import SparseMoE


def _moe(num_experts: int, top_k: int) -> SparseMoE:
    config = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=8,
        norm_topk_prob=True,
        shared_expert_intermediate_size=0,
        sparse_layers=(True,),
        checkpoint_prefix="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
    )
    return SparseMoE(16, config)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "expected"), [(128, 8, [1, 16, 128]), (8, 2, [1, 64]), (60, 4, [1, 32, 64])]
)
def test_warm_up_token_counts_reach_each_kernel_variant(num_experts, top_k, expected, monkeypatch):
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    moe = _moe(num_experts, top_k)
    counts = moe.warm_up_token_counts()
    assert counts == expected
    variants = {moe.kernel_variant(t) for t in counts}
    every = {moe.kernel_variant(t) for t in range(1, 8193)}
    assert variants == every  # nothing a batch of up to 8192 tokens takes is left out
    # A decode batch takes the decode kernels, a long prompt the grouped ones.
    assert moe.kernel_variant(1)[0] == "decode" and moe.kernel_variant(4096)[0] == "grouped"


def test_the_dispatched_experts_warm_up_reaches_both_row_tiles():
    """Under all-to-all expert parallelism the grouped kernels take one expert per row (top_k 1)."""
    from gpuworker.kernels.moe.fused import block_m_for
    from gpuworker.models.tensor_parallel import ParallelContext

    config = _moe(8, 2).config
    moe = SparseMoE(16, config, ParallelContext(1, 2, dispatch_experts=True))
    tiles = {block_m_for(rows, moe.num_local_experts) for rows in moe.dispatched_row_counts()}
    assert tiles == {block_m_for(rows, moe.num_local_experts) for rows in range(1, 8193)} == {16, 64}
    moe.w13.data.zero_()
    moe.w2.data.zero_()
    moe.warm_up()  # runs on the CPU reference, with no collective


def test_a_tuned_decode_config_per_bucket_is_warmed_up_too(monkeypatch, kernel_configs):
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    moe = _moe(128, 8)
    kernel_configs(
        "moe_decode",
        TABLE_KEY,
        [
            dict(hidden=16, inter=8, top_k=8, tokens=2, config="gate_up=n8-k64-w2-p1,down=n8-k64-w2-p1"),
            dict(hidden=16, inter=8, top_k=8, tokens=8, config="grouped"),
        ],
    )
    assert moe.warm_up_token_counts() == [1, 2, 8, 128]  # 4 takes the default, as 1 does
    assert moe.kernel_variant(8) == ("grouped", 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_runs_the_kernels_at_each_count():
    moe = _moe(8, 2).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(moe.w13)
    torch.nn.init.normal_(moe.w2)
    moe.warm_up()  # compiles and runs every variant without a collective
