"""DeepSeek-V2/V3 under tensor and expert parallelism on CPU with gloo: two ranks through LLMEngine equal
one rank token for token. Latent attention splits by heads (q_proj or q_b_proj and kv_b_proj by rows,
o_proj by columns) while the latent, the rotary key and the paged latent cache stay whole on every
rank; the experts split by expert, joined by all-reduce or by all-to-all dispatch; the dense first
layer and the shared experts split like the llama MLP. A model that does not split is refused before
any worker starts."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.models.loader import load_model, load_model_config
from gpuworker.models.tensor_parallel import ParallelContext
from tests.gpuworker.models.deepseek_checkpoints import make_mla_checkpoint

# Mixed lengths and a small token budget: chunked prefills share steps with absorbed decodes.
PROMPTS = [[1, 5, 9, 200, 17], list(range(3, 60)), [7] * 20, [11, 300, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
EXACT = {"rtol": 0, "atol": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built = {}

    def build(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_mla_checkpoint(tmp_path_factory.mktemp("mla"), family, **overrides)
        return built[key]

    return build


def _generate(engine: LLMEngine) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "expert_parallel", "overrides"),
    [
        # q_lora_rank, grouped sigmoid routing over 16 experts, one shared expert, YaRN.
        ("deepseek-v3-moe", "all_reduce", {}),
        ("deepseek-v3-moe", "all_to_all", {}),
        # One q_proj, softmax greedy routing, two shared experts.
        ("deepseek-v2-moe", "all_to_all", {}),
        # Dense layers only; biases on q_a_proj, kv_a_proj_with_mqa (whole on each rank) and o_proj
        # (added once after the all-reduce); a vocabulary the ranks do not split evenly.
        ("deepseek-v3", "all_reduce", {"attention_bias": True, "vocab_size": 383}),
    ],
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tp2_matches_tp1(checkpoint, family, expert_parallel, overrides, kv_cache_dtype):
    # fp8: each rank's whole latent cache in FP8, quantized as the unsplit model's.
    path = checkpoint(family, **overrides)
    common = {"max_num_batched_tokens": 32, "kv_cache_dtype": kv_cache_dtype}
    expected = _generate(LLMEngine(path, **common))
    engine = LLMEngine(path, tensor_parallel_size=2, expert_parallel=expert_parallel, **common)
    try:
        model = engine.runner.model
        assert model.parallel.world_size == 2 and model.layers[0].self_attn.num_heads == 2
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("deepseek-v3-moe", {}), ("deepseek-v2-moe", {}), ("deepseek-v3", {"attention_bias": True})],
)
def test_each_rank_loads_its_heads_and_the_whole_latent(checkpoint, family, overrides):
    mc = load_model_config(checkpoint(family, **overrides))
    whole = load_model(mc)
    ranks = [load_model(mc, parallel=ParallelContext(rank, 2)) for rank in range(2)]
    vocab = torch.cat([r.embed_tokens for r in ranks])[: mc.vocab_size]
    torch.testing.assert_close(vocab, whole.embed_tokens, **EXACT)
    for i, layer in enumerate(whole.layers):
        attn, parts = layer.self_attn, [r.layers[i].self_attn for r in ranks]
        query = "q_proj" if attn.q_proj is not None else "q_b_proj"
        for module in (query, "kv_b_proj"):
            rows = torch.cat([getattr(p, module).weight for p in parts])
            torch.testing.assert_close(rows, getattr(attn, module).weight, **EXACT)
        torch.testing.assert_close(torch.cat([p.o_proj.weight for p in parts], dim=1), attn.o_proj.weight, **EXACT)
        for part in parts:  # per token, not per head: whole on every rank
            for module in ("kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_proj", "q_a_layernorm"):
                if getattr(attn, module) is not None:
                    torch.testing.assert_close(getattr(part, module).weight, getattr(attn, module).weight, **EXACT)
            for module in ("kv_a_proj_with_mqa", "o_proj"):
                if getattr(attn, module).bias is not None:
                    torch.testing.assert_close(getattr(part, module).bias, getattr(attn, module).bias, **EXACT)
        mlp, mlps = layer.mlp, [r.layers[i].mlp for r in ranks]
        if hasattr(mlp, "w13"):
            torch.testing.assert_close(torch.cat([p.w13 for p in mlps]), mlp.w13, **EXACT)
            mlp, mlps = mlp.shared_expert, [p.shared_expert for p in mlps]
        torch.testing.assert_close(torch.cat([p.down_proj.weight for p in mlps], dim=1), mlp.down_proj.weight, **EXACT)


def test_heads_that_do_not_split_are_refused_before_any_worker(checkpoint):
    path = checkpoint("deepseek-v3-moe")  # 4 heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLMEngine(path, tensor_parallel_size=3)
    assert not multiprocessing.active_children()


def test_experts_that_do_not_split_are_refused_before_any_worker(checkpoint):
    path = checkpoint("deepseek-v2-moe", n_routed_experts=6)  # 4 heads split, 6 experts do not
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by tensor_parallel_size \(4\)"):
        LLMEngine(path, tensor_parallel_size=4, expert_parallel="all_to_all")
    assert not multiprocessing.active_children()
