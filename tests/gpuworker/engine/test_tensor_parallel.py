"""Tensor parallelism on CPU with gloo: TP=2 through LLMEngine equals TP=1 token for token (dense and
MoE families, the MoE's experts joined by all-reduce or by all-to-all dispatch), each rank loads
exactly its shard, and a rank that dies or hangs makes the engine fail with a clear error instead of
hanging."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.models.loader import load_model, load_model_config, with_quantization
from gpuworker.models.tensor_parallel import ParallelContext, shard_config

# Mixed lengths and a small token budget: chunked prefills share steps with decodes.
PROMPTS = [[1, 5, 9, 200, 17], list(range(3, 60)), [7] * 20, [11, 300, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _generate(engine: LLMEngine) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        # One KV head for two ranks (replicated), biases on every projection, a vocabulary that does
        # not split evenly (the last rank's slice is padded).
        ("llama-bias", {"num_key_value_heads": 1, "vocab_size": 383}),
        ("qwen3-moe", {}),
        # A shared expert (split like a dense MLP) and a dense first layer.
        ("qwen2-moe", {}),
    ],
)
def test_tp2_matches_tp1(tiny_checkpoint, family, overrides):
    path = tiny_checkpoint(family, **overrides)
    expected = _generate(LLMEngine(path, max_num_batched_tokens=32))
    engine = LLMEngine(path, tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        assert engine.runner.model.parallel.world_size == 2
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_tp2_matches_tp1_on_an_fp8_kv_cache(tiny_checkpoint):
    # Each rank's cache holds its KV heads in FP8, quantized as the unsplit model's are.
    path = tiny_checkpoint("llama")
    expected = _generate(LLMEngine(path, max_num_batched_tokens=32, kv_cache_dtype="fp8"))
    engine = LLMEngine(path, tensor_parallel_size=2, max_num_batched_tokens=32, kv_cache_dtype="fp8")
    try:
        assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("family", ["llama-bias", "qwen2-moe"])
def test_each_rank_loads_its_shard(tiny_checkpoint, family):
    """The shards of two ranks put together are the unsplit model's weights: rows of the
    column-parallel projections, columns of the row-parallel ones, whole experts, vocabulary rows."""
    mc = load_model_config(tiny_checkpoint(family))
    whole = load_model(mc)
    ranks = [load_model(mc, parallel=ParallelContext(rank, 2)) for rank in range(2)]
    local = shard_config(mc, ranks[0].parallel)
    q, kv = local.q_size, local.kv_size
    vocab = torch.cat([r.embed_tokens for r in ranks])[: mc.vocab_size]
    torch.testing.assert_close(vocab, whole.embed_tokens, rtol=0, atol=0)
    for i, layer in enumerate(whole.layers):
        parts = [r.layers[i] for r in ranks]
        qkv = [p.self_attn.qkv_proj.weight for p in parts]
        torch.testing.assert_close(
            torch.cat([w[:q] for w in qkv]), layer.self_attn.qkv_proj.weight[: mc.q_size], rtol=0, atol=0
        )
        torch.testing.assert_close(
            torch.cat([w[q : q + kv] for w in qkv]),
            layer.self_attn.qkv_proj.weight[mc.q_size : mc.q_size + mc.kv_size],
            rtol=0,
            atol=0,
        )
        torch.testing.assert_close(
            torch.cat([p.self_attn.o_proj.weight for p in parts], dim=1), layer.self_attn.o_proj.weight, rtol=0, atol=0
        )
        mlp = layer.mlp
        if hasattr(mlp, "w13"):
            torch.testing.assert_close(torch.cat([p.mlp.w13 for p in parts]), mlp.w13, rtol=0, atol=0)
            torch.testing.assert_close(torch.cat([p.mlp.w2 for p in parts]), mlp.w2, rtol=0, atol=0)
            mlp = mlp.shared_expert
            parts_mlp = [p.mlp.shared_expert for p in parts]
        else:
            parts_mlp = [p.mlp for p in parts]
        if mlp is not None:
            torch.testing.assert_close(
                torch.cat([p.down_proj.weight for p in parts_mlp], dim=1), mlp.down_proj.weight, rtol=0, atol=0
            )


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_holds_only_its_share_of_the_experts(tiny_checkpoint, world):
    """Expert parallel: each rank allocates and loads num_experts / N experts, 1/N of the experts' memory."""
    mc = load_model_config(tiny_checkpoint("qwen3-moe"))

    def expert_bytes(model) -> int:
        return sum(
            p.numel() * p.element_size()
            for layer in model.layers
            for name, p in layer.mlp.named_parameters()
            if name in ("w13", "w2")
        )

    whole = expert_bytes(load_model(mc))
    for rank in range(world):
        model = load_model(mc, parallel=ParallelContext(rank, world))
        assert model.layers[0].mlp.num_local_experts == mc.moe.num_experts // world
        assert expert_bytes(model) * world == whole


def test_replicated_kv_heads_go_to_the_ranks_that_read_them(tiny_checkpoint):
    """With four ranks and two KV heads, ranks 0-1 hold head 0 and ranks 2-3 head 1."""
    mc = load_model_config(tiny_checkpoint("llama"))
    whole = load_model(mc).layers[0].self_attn.qkv_proj.weight
    hd = mc.head_dim
    for rank in range(4):
        model = load_model(mc, parallel=ParallelContext(rank, 4))
        qkv = model.layers[0].self_attn.qkv_proj.weight
        head = rank // 2
        k_rows = whole[mc.q_size + head * hd : mc.q_size + (head + 1) * hd]
        torch.testing.assert_close(qkv[hd : 2 * hd], k_rows, rtol=0, atol=0)


def test_a_model_that_does_not_split_is_refused(tiny_checkpoint):
    path = tiny_checkpoint("llama")  # 4 attention heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLMEngine(path, tensor_parallel_size=3)
    assert not multiprocessing.active_children()  # refused before any worker started


def test_quantized_models_split_as_their_scales_allow(tiny_checkpoint):
    # FP8 quantized at load keeps a scale per output channel: a rank takes its channels' scales.
    # Block FP8, and INT4's refusal: test_tensor_parallel_quantized.
    mc = with_quantization(load_model_config(tiny_checkpoint("llama")), "fp8")
    assert shard_config(mc, ParallelContext(0, 2)).num_heads * 2 == mc.num_heads
    layer = load_model(mc, parallel=ParallelContext(1, 2)).layers[0]
    assert layer.mlp.down_proj.weight_fp8.shape == (mc.hidden_size, mc.intermediate_size // 2)
    assert shard_config(mc, ParallelContext(0, 1)) is mc  # one rank: nothing to split


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_tensor_parallel_size_is_checked(tiny_checkpoint, value):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLMEngine(tiny_checkpoint("llama"), tensor_parallel_size=value)


def test_a_rank_that_dies_fails_the_engine_clearly(tiny_checkpoint):
    engine = LLMEngine(tiny_checkpoint("llama"), tensor_parallel_size=2)
    try:
        _generate(engine)
        worker = engine.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            _generate(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("family", "expert_parallel"), [("llama", "all_reduce"), ("mixtral", "all_to_all")])
def test_a_rank_that_hangs_times_out_the_step(tiny_checkpoint, family, expert_parallel):
    engine = LLMEngine(
        tiny_checkpoint(family), tensor_parallel_size=2, expert_parallel=expert_parallel, distributed_timeout_s=5
    )
    worker = engine.workers.processes[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(RuntimeError, match="tensor-parallel step failed"):
            _generate(engine)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_expert_parallel_all_to_all_matches_one_rank(tiny_checkpoint, family):
    """Experts split over two ranks, each rank's slice of the tokens dispatched to the experts'
    ranks and combined back (models.expert_parallel); qwen2-moe adds a shared expert and a dense
    first layer."""
    path = tiny_checkpoint(family)
    expected = _generate(LLMEngine(path, max_num_batched_tokens=32))
    engine = LLMEngine(path, tensor_parallel_size=2, expert_parallel="all_to_all", max_num_batched_tokens=32)
    try:
        moe = engine.runner.model.layers[-1].mlp
        assert moe.parallel.dispatch_experts and moe.num_local_experts * 2 == moe.config.num_experts
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


def test_experts_that_do_not_split_over_the_ranks_are_refused(tiny_checkpoint):
    path = tiny_checkpoint("mixtral", num_local_experts=3)
    with pytest.raises(ValueError, match=r"num_experts \(3\) is not divisible by tensor_parallel_size \(2\)"):
        LLMEngine(path, tensor_parallel_size=2, expert_parallel="all_to_all")
    assert not multiprocessing.active_children()  # refused before any worker started


@pytest.mark.parametrize("value", ["alltoall", None, 1])
def test_expert_parallel_is_checked(tiny_checkpoint, value):
    with pytest.raises(ValueError, match=r"expert_parallel must be one of \('all_reduce', 'all_to_all'\)"):
        LLMEngine(tiny_checkpoint("mixtral"), tensor_parallel_size=2, expert_parallel=value)


def test_a_rank_that_dies_fails_an_expert_parallel_engine_clearly(tiny_checkpoint):
    engine = LLMEngine(tiny_checkpoint("mixtral"), tensor_parallel_size=2, expert_parallel="all_to_all")
    try:
        _generate(engine)
        worker = engine.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            _generate(engine)
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    ("family", "expert_parallel"), [("llama", "all_reduce"), ("qwen3-moe", "all_reduce"), ("qwen3-moe", "all_to_all")]
)
def test_tp2_on_two_gpus_matches_one_gpu(tiny_checkpoint, family, expert_parallel):
    """NCCL on two GPUs: the Triton kernels over each rank's heads and experts give one GPU's tokens
    (with the experts' choices dispatched between the GPUs, too)."""
    path = tiny_checkpoint(family)
    kwargs = dict(device="cuda", dtype="float32", num_kv_blocks=128, max_model_len=512, max_num_seqs=8)
    expected = _generate(LLMEngine(path, **kwargs))
    engine = LLMEngine(path, tensor_parallel_size=2, expert_parallel=expert_parallel, **kwargs)
    try:
        assert os.environ["NCCL_NVLS_ENABLE"] == "0"
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
