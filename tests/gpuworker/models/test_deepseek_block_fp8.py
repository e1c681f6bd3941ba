"""DeepSeek-V2/V3 block-wise FP8 checkpoints (the format DeepSeek-V3/R1 and Kimi K2 ship in): the latent
attention's projections, the dense MLP and the shared experts load as BlockFp8Linear, the routed
experts as BlockFp8Experts, all e4m3 with their block scales; kv_b_proj is dequantised at load (the
absorbed decode splits it per head); routers and norms stay float. Greedy tokens equal transformers
on the dequantised twin with each quantized projection's input rounded through FP8 per token and
group of 128 columns, as the format's kernels do."""

from __future__ import annotations

import json

import pytest
import torch

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE
from gpuworker.models.layers import GatedMLP
from gpuworker.models.loader import load_model
from gpuworker.models.moe import SparseMoE
from gpuworker.models.quantization.block_fp8 import BlockFp8Linear, DequantizedBlockFp8Linear
from tests.gpuworker.models.deepseek_checkpoints import make_mla_checkpoint
from tests.gpuworker.quantized_checkpoints import dequantize_block_fp8, hf_reference, quantize_checkpoint

SCHEME = "fp8-block"
MAX_TOKENS = 12


def make_block_fp8_deepseek(tmp_path, family: str):
    """(quantized, dequantised twin) of a tiny random DeepSeek checkpoint, in DeepSeek-V3's on-disk
    format: weight e4m3 and weight_scale_inv per 128 x 128 block, quantization_config as DeepSeek's."""
    source = make_mla_checkpoint(tmp_path / "float", family)
    return quantize_checkpoint(source, tmp_path / family, SCHEME)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return make_block_fp8_deepseek(tmp_path_factory.mktemp("ds"), "deepseek-v3-moe")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(7)).tolist()


def test_quantization_config_is_deepseeks(v3):
    quantized, _ = v3
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }


def test_weights_stay_fp8_and_kv_b_proj_is_dequantised(v3):
    from safetensors.torch import load_file

    quantized, _ = v3
    model = load_model(quantized, dtype="bfloat16")
    stored = load_file(str(next(quantized.glob("*.safetensors"))))
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        for module in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj):
            assert isinstance(module, BlockFp8Linear) and not isinstance(module, DequantizedBlockFp8Linear)
            assert module.weight_fp8.dtype == FP8_DTYPE and module.weight_scale_inv.dtype == torch.float32
        assert isinstance(attn.kv_b_proj, DequantizedBlockFp8Linear)
        name = f"model.layers.{i}.self_attn.kv_b_proj"
        expected = dequantize_block_fp8(stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"], [128, 128])
        torch.testing.assert_close(attn.kv_b_proj.weight.float(), expected.bfloat16().float(), rtol=0, atol=0)
        assert attn.kv_b_proj.weight.dtype == torch.bfloat16
        assert attn.kv_a_layernorm.weight.dtype == torch.bfloat16
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            assert isinstance(mlp.gate_up_proj, BlockFp8Linear) and isinstance(mlp.down_proj, BlockFp8Linear)
        else:
            assert isinstance(mlp, SparseMoE) and mlp.w13 is None
            assert mlp.block_fp8_experts.w13.dtype == FP8_DTYPE
            assert isinstance(mlp.shared_expert.gate_up_proj, BlockFp8Linear)
            assert mlp.gate.weight.dtype == torch.float32  # DeepSeek's router runs in float32
            assert mlp.e_score_correction_bias.dtype == torch.float32
    assert isinstance(model.layers[0].mlp, GatedMLP) and isinstance(model.layers[1].mlp, SparseMoE)


# deepseek-v3-moe: q_lora_rank, grouped sigmoid routing with its correction bias, YaRN;
# deepseek-v2-moe: one q_proj, softmax greedy routing, two shared experts.
@pytest.mark.parametrize("family", ["deepseek-v3-moe", "deepseek-v2-moe"])
def test_greedy_equals_transformers_on_the_same_checkpoint(family, v3, prompt, tmp_path):
    quantized, twin = v3 if family == "deepseek-v3-moe" else make_block_fp8_deepseek(tmp_path, family)
    reference_model = hf_reference(quantized, twin, SCHEME, read_quantized=False)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None
        )
    engine = LLMEngine(quantized, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    assert all(m.block_fp8_experts is not None for m in engine.runner.model.modules() if isinstance(m, SparseMoE))
    [output] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert output.outputs[0].token_ids == out[0, ids.shape[1] :].tolist()


def test_fp8_at_load_is_refused_for_deepseek(tmp_path):
    path = make_mla_checkpoint(tmp_path, "deepseek-v3")
    with pytest.raises(ValueError, match=r"quantization: .*block-wise FP8 checkpoints .* only, not fp8-at-load"):
        load_model(path, quantization="fp8")


def test_logits_equal_transformers_through_prefill_and_absorbed_decode(v3, prompt):
    from gpuworker.models.loader import load_model_config
    from tests.gpuworker.models.test_deepseek_parity import LatentBatcher

    quantized, twin = v3
    mc = load_model_config(quantized)
    model = load_model(mc)
    with torch.no_grad():
        expected = hf_reference(quantized, twin, SCHEME, read_quantized=False)(torch.tensor([prompt])).logits[0]
    batcher = LatentBatcher(mc)
    pieces = []
    for chunk in [prompt[:16], *([token] for token in prompt[16:])]:  # a prefill, then decodes
        input_ids, positions, meta = batcher.batch([("s", chunk)])
        with torch.no_grad():
            pieces.append(model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta)))
    torch.testing.assert_close(torch.cat(pieces), expected, rtol=1e-5, atol=1e-4)


def test_a_split_that_cuts_a_scale_block_is_refused_before_any_worker(v3):
    # Two ranks' 2 heads of q_b_proj are 64 rows, half a 128-row block: their scales do not split.
    # (Whole blocks split: tests/gpuworker/engine/test_tensor_parallel_quantized.py.)
    import multiprocessing

    with pytest.raises(
        ValueError,
        match=r"quantization: num_attention_heads \* qk_head_dim \(128\) split over tensor_parallel_size \(2\) "
        r"gives 64 per rank, not a multiple of the weight_block_size \[128, 128\]",
    ):
        LLMEngine(v3[0], tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def test_gpu_kernels_equal_the_reference_under_the_interpreter(v3, prompt, monkeypatch):
    # The GPU path on Triton's interpreter: the block FP8 GEMM of the attention projections, dense
    # MLP and shared experts, the block FP8 experts, the latent cache write and the absorbed MLA
    # decode reading the dequantised kv_b_proj; the same logits as the CPU reference path.
    from gpuworker.attention.triton_backend import TritonAttentionBackend
    from gpuworker.models.loader import load_model_config
    from gpuworker.models.quantization import block_fp8, block_fp8_experts
    from tests.gpuworker.models.test_deepseek_parity import LatentBatcher

    quantized, _ = v3
    mc = load_model_config(quantized)
    model = load_model(mc)

    def logits() -> torch.Tensor:
        batcher, pieces = LatentBatcher(mc), []
        for chunk in [prompt[:16], *([token] for token in prompt[16:20])]:
            input_ids, positions, meta = batcher.batch([("s", chunk)])
            with torch.no_grad():
                pieces.append(model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta)))
        return torch.cat(pieces)

    expected = logits()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(model, "attn_backend", TritonAttentionBackend())
    monkeypatch.setattr(block_fp8, "block_fp8_matmul_reference", block_fp8.block_fp8_matmul)
    monkeypatch.setattr(block_fp8_experts, "experts_block_fp8_reference", block_fp8_experts.fused_moe_block_fp8)
    torch.testing.assert_close(logits(), expected, rtol=1e-4, atol=1e-4)


def test_dummy_weights_of_the_right_dtypes(v3, prompt):
    # load_format "dummy" (benchmarks of full-size shapes): FP8 values, float scales, a float kv_b_proj.
    from gpuworker.models.loader import load_model_config
    from tests.gpuworker.models.test_deepseek_parity import LatentBatcher

    quantized, _ = v3
    mc = load_model_config(quantized)
    model = load_model(mc, dtype="bfloat16", load_format="dummy")
    attn = model.layers[1].self_attn
    assert attn.q_b_proj.weight_fp8.dtype == FP8_DTYPE and attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert attn.kv_b_proj.weight.abs().sum() > 0
    batcher = LatentBatcher(mc)
    input_ids, positions, meta = batcher.batch([("s", prompt)])
    batcher.kv_caches = [cache.bfloat16() for cache in batcher.kv_caches]
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta))
    assert torch.isfinite(logits).all()
