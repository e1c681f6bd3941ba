"""The engine serves a DeepSeek (multi-head latent attention) checkpoint greedily, token for token
as transformers: batched, with chunked prefill forced, and a second pass from the prefix cache
(whose prefill chunks attend to latents cached by the first pass); its KV pool holds only the latent
and the rotary key per token and layer."""

from __future__ import annotations

import pytest
import torch

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.engine.sizing import kv_cache_block_bytes
from tests.gpuworker.engine.reference import hf_greedy, random_prompts
from tests.gpuworker.models.deepseek_checkpoints import MLA_TINY, make_mla_checkpoint

LENGTHS = (1, 16, 31, 47, 100)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek-v2", "deepseek-v3-yarn", "deepseek-v3-moe"])
def case(request, tmp_path_factory):
    path = make_mla_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)
    prompts = random_prompts(LENGTHS, MLA_TINY["vocab_size"], seed=3)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def engine(path, **overrides) -> LLMEngine:
    kwargs = dict(num_kv_blocks=64, max_model_len=160)
    kwargs.update(overrides)
    return LLMEngine(path, device="cpu", dtype="float32", **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_prefill_then_prefix_cache_hit(case, async_scheduling):
    path, prompts, reference = case
    llm = engine(path, max_num_batched_tokens=24, max_num_seqs=3, async_scheduling=async_scheduling)
    first = llm.generate(prompts, GREEDY)
    assert [out.token_ids for out in first] == reference
    second = llm.generate(prompts, GREEDY)
    assert [out.token_ids for out in second] == reference
    assert [out.num_cached_tokens for out in second] == [(n - 1) // 16 * 16 for n in LENGTHS]


def test_kv_cache_holds_the_latent_and_rope_key_per_token(case):
    path, _, _ = case
    llm = engine(path)
    mc = llm.model_config
    width = MLA_TINY["kv_lora_rank"] + MLA_TINY["qk_rope_head_dim"]
    cache = llm.runner.kv_cache
    assert cache.shape == (mc.num_layers, 1, 64, 16, 1, width)
    per_token = mc.num_layers * width * cache.element_size()
    assert cache.numel() * cache.element_size() == 64 * 16 * per_token
    assert kv_cache_block_bytes(mc, 16, cache.element_size()) == 16 * per_token


def test_v2_lite_shapes_cache_576_values_per_token_and_layer():
    from gpuworker.models.config import ModelConfig

    v2_lite = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
    }
    mc = ModelConfig.from_hf(v2_lite)
    assert mc.kv_cache_layout == (1, 1, 576)
    assert kv_cache_block_bytes(mc, 16, torch.bfloat16.itemsize) == 27 * 16 * (512 + 64) * 2


def test_a_rank_holds_its_heads_and_the_whole_latent(case):
    # Tensor parallelism splits latent attention by heads; the latent cache stays per token.
    from gpuworker.attention.torch_backend import TorchAttentionBackend
    from gpuworker.models.deepseek.model import DeepseekForCausalLM
    from gpuworker.models.loader import load_model_config
    from gpuworker.models.tensor_parallel import ParallelContext, shard_config

    mc = load_model_config(case[0])
    with torch.device("meta"):
        model = DeepseekForCausalLM(mc, TorchAttentionBackend(), ParallelContext(1, 2))
    attn, mla = model.layers[0].self_attn, mc.mla
    assert attn.num_heads == mc.num_heads // 2
    assert attn.kv_b_proj.weight.shape[0] == mc.num_heads // 2 * (mla.qk_nope_head_dim + mla.v_head_dim)
    assert attn.kv_a_proj_with_mqa.weight.shape[0] == mla.cache_width
    assert shard_config(mc, model.parallel).kv_cache_layout == mc.kv_cache_layout


def test_sizing_counts_the_latent_attention_weights():
    from gpuworker.engine.sizing import decoder_layer_weights
    from gpuworker.models.config import ModelConfig

    config = {"architectures": ["DeepseekV3ForCausalLM"], **MLA_TINY, "q_lora_rank": 48}
    mc = ModelConfig.from_hf(config)
    h, heads = MLA_TINY["hidden_size"], MLA_TINY["num_attention_heads"]
    attention = 48 * (h + heads * 32) + h * 48 + 32 * heads * (16 + 24) + heads * 24 * h
    assert decoder_layer_weights(mc) == 2 * (attention + 3 * h * MLA_TINY["intermediate_size"])


def test_an_odd_hidden_size_per_head_is_no_rotary_width_for_latent_attention():
    from gpuworker.models.config import ModelConfig

    # The rotary width is qk_rope_head_dim; hidden_size / heads (here 21) plays no part.
    config = {"architectures": ["DeepseekV2ForCausalLM"], **MLA_TINY, "hidden_size": 84, "q_lora_rank": None}
    config.pop("head_dim", None)
    assert ModelConfig.from_hf(config).mla.qk_rope_head_dim == 16


def test_fp8_kv_cache_decodes_as_the_model_dtype_cache(case):
    """The latent cache in float8_e4m3fn: a quarter of float32's bytes per token, and decoding within
    FP8's rounding of what the float32 cache decodes. Every head's keys and values are expanded from
    the one rounded latent, so the tiny model's first-token log-probabilities move by up to ~0.2 for
    the likeliest token and ~0.55 for the fifth (measured); greedy decoding agrees on every first
    token and on most tokens before the sequences part (where two logits lie closer than that)."""
    from tests.gpuworker.engine.test_kv_cache_dtype import first_token_logprobs

    path, prompts, _ = case
    if "moe" in path.name:
        pytest.skip("FP8's rounding can flip a token's expert choice, which moves its logits by more than the rounding")
    fp8, auto = engine(path, kv_cache_dtype="fp8"), engine(path)
    assert fp8.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.runner.kv_cache.nbytes * 4 == auto.runner.kv_cache.nbytes
    for expected, got in zip(first_token_logprobs(auto, prompts), first_token_logprobs(fp8, prompts), strict=True):
        top = max(expected, key=expected.get)
        assert top == max(got, key=got.get) and abs(expected[top] - got[top]) < 0.3
        shared = set(expected) & set(got)
        assert len(shared) >= 4 and max(abs(expected[t] - got[t]) for t in shared) < 0.8
    agreeing = []
    for a, b in zip(auto.generate(prompts, GREEDY), fp8.generate(prompts, GREEDY), strict=True):
        agreeing.append(next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), MAX_TOKENS))
    assert min(agreeing) >= 1 and sum(agreeing) >= 0.5 * MAX_TOKENS * len(prompts), agreeing


def test_second_pass_reads_the_fp8_latent_prefix_cache(case):
    path, prompts, _ = case
    llm = engine(path, kv_cache_dtype="fp8", max_num_batched_tokens=24, max_num_seqs=3)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert [out.num_cached_tokens for out in second] == [(n - 1) // 16 * 16 for n in LENGTHS]
    assert [out.token_ids for out in second] == [out.token_ids for out in first]


def test_checkpoint_k_scales_scale_the_fp8_latent_cache(case, tmp_path):
    from tests.gpuworker.engine.test_kv_cache_dtype import with_tensors

    path, prompts, _ = case
    scales = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.05) for i in range(MLA_TINY["num_hidden_layers"])}
    scaled = engine(with_tensors(path, tmp_path / "scaled", scales), kv_cache_dtype="fp8")
    assert [layer.self_attn.k_scale for layer in scaled.runner.model.layers] == [pytest.approx(0.05)] * 2
    plain = engine(path, kv_cache_dtype="fp8")
    # The same prompts cached over another scale: other bytes in the cache (the tokens are the FP8
    # test's business).
    scaled.generate(prompts, GREEDY)
    plain.generate(prompts, GREEDY)
    assert not torch.equal(scaled.runner.kv_cache.view(torch.uint8), plain.runner.kv_cache.view(torch.uint8))


def test_the_deepseek_v2_lite_shape_builds_with_its_latent_cache_and_experts():
    """bench/configs/deepseek-v2-lite (the benchmarks' shape): 576 cached values per token and layer,
    layer 0 dense and the other 26 mixtures of experts; built on the meta device (no memory)."""
    import json
    from pathlib import Path

    from gpuworker.attention.torch_backend import TorchAttentionBackend
    from gpuworker.models.config import ModelConfig
    from gpuworker.models.deepseek.model import DeepseekForCausalLM
    from gpuworker.models.moe import SparseMoE

    path = Path(__file__).resolve().parents[3] / "bench" / "configs" / "deepseek-v2-lite" / "config.json"
    mc = ModelConfig.from_hf(json.loads(path.read_text()))
    assert mc.kv_cache_layout == (1, 1, 576)
    assert kv_cache_block_bytes(mc, 16, 2) == mc.num_layers * 16 * 576 * 2
    with torch.device("meta"):
        model = DeepseekForCausalLM(mc, TorchAttentionBackend())
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == [False] + [True] * (mc.num_layers - 1)


def test_triton_backend_batches_prefill_chunks_token_for_token(case, monkeypatch):
    """The GPU path on Triton's interpreter: a step's prefill chunks (forced small, so chunks follow
    cached prefixes, and a second pass hits the prefix cache) go through one MLA prefill launch per
    layer, and the tokens are transformers'."""
    from gpuworker.attention.triton_backend import TritonAttentionBackend
    from tests.kernels.sm90_compile import record_launches

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = record_launches(monkeypatch)
    path, prompts, reference = case
    llm = engine(path, attn_backend=TritonAttentionBackend(), max_num_batched_tokens=24, max_num_seqs=3)
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == reference
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == reference
    prefills = launches["_mla_prefill_kernel"]
    assert prefills and any(launch.arguments["cu_seqlens_q_ptr"].shape[0] > 2 for launch in prefills)
