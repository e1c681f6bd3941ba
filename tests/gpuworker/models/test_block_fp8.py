"""Block-wise FP8 checkpoints (DeepSeek's weight + weight_scale_inv per 128 x 128 block): the weights
stay FP8 in memory with their block scales, the greedy tokens equal transformers' reading the same
checkpoint (on a CPU transformers dequantises the weights at load; its projections round their inputs
through FP8 per token and group of 128 columns here, as the format's kernels do), ragged blocks, and
what a broken or unsupported checkpoint says.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE
from gpuworker.models.loader import load_model, load_model_config
from gpuworker.models.moe import SparseMoE
from gpuworker.models.quantization.block_fp8 import BlockFp8Linear
from tests.gpuworker.models.paged_batch import PagedBatcher
from tests.gpuworker.quantized_checkpoints import hf_reference, make_quantized_checkpoint

SCHEME = "fp8-block"
MAX_TOKENS = 12
TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_quantized_checkpoint(tmp_path_factory.mktemp("block"), SCHEME)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(7)).tolist()


def _logits(model, mc, prompt: list[int]) -> torch.Tensor:
    batcher = PagedBatcher(mc)
    input_ids, positions, meta = batcher.batch([("s", prompt)])
    with torch.no_grad():
        return model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_stay_fp8_with_their_block_scales(checkpoint, dtype):
    quantized, _ = checkpoint
    model = load_model(quantized, dtype=dtype)
    linears = [m for m in model.modules() if isinstance(m, BlockFp8Linear)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down in each of the two layers
    for linear in linears:
        assert linear.weight is None
        assert linear.weight_fp8.dtype == FP8_DTYPE
        assert linear.weight_scale_inv.dtype == torch.float32
        # No float copy of the weight anywhere in the module: only the FP8 values are weight-sized.
        weight_sized = [t for t in (*linear.parameters(), *linear.buffers()) if t.numel() >= linear.weight_fp8.numel()]
        assert [t.dtype for t in weight_sized] == [FP8_DTYPE]
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    # k (64 rows) ends inside a 128-row block: every output row keeps its block's scales.
    assert (qkv.group_n, tuple(qkv.weight_scale_inv.shape)) == (1, (256, 1))
    # gate and up are whole blocks: their block scales are kept as they are, one row per 128 outputs.
    assert (gate_up.group_n, tuple(gate_up.weight_scale_inv.shape)) == (128, (4, 1))
    stored = load_file(str(next(quantized.glob("*.safetensors"))))
    assert torch.equal(gate_up.weight_scale_inv[2:], stored["model.layers.0.mlp.up_proj.weight_scale_inv"])
    assert torch.equal(
        model.layers[1].mlp.down_proj.weight_fp8.float(), stored["model.layers.1.mlp.down_proj.weight"].float()
    )


def test_transformers_reads_the_helper_checkpoint_as_its_twin(checkpoint):
    # The on-disk layout is transformers' FineGrainedFP8: it dequantises it to the twin's weights.
    from transformers import AutoModelForCausalLM

    quantized, twin = checkpoint
    read = AutoModelForCausalLM.from_pretrained(str(quantized), dtype=torch.float32).state_dict()
    expected = AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).state_dict()
    assert read.keys() == expected.keys()
    assert all(torch.equal(read[name], expected[name]) for name in expected)


# Qwen3's FP8 checkpoints (Qwen3-8B-FP8 and the rest) are this layout too: q/k norms, head_dim 32
# apart from hidden_size / heads.
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_equals_transformers_on_the_same_checkpoint(family, checkpoint, prompt, tmp_path):
    quantized, twin = checkpoint if family == "llama" else make_quantized_checkpoint(tmp_path, SCHEME, family)
    reference_model = hf_reference(quantized, twin, SCHEME)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None
        )
    reference = out[0, ids.shape[1] :].tolist()
    engine = LLMEngine(quantized, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    [output] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert output.outputs[0].token_ids == reference


def test_ragged_blocks_equal_the_dequantised_twin(tmp_path, prompt):
    # 320 intermediate rows and columns: gate, up and down end in a partial block (64 of 128), both in
    # their outputs and in down's inputs, and gate's last block is not up's first.
    quantized, twin = make_quantized_checkpoint(tmp_path, SCHEME, intermediate_size=320)
    mc = load_model_config(quantized)
    model = load_model(mc)
    gate_up = model.layers[0].mlp.gate_up_proj
    assert gate_up.group_n == 1 and tuple(gate_up.weight_scale_inv.shape) == (640, 1)
    assert tuple(model.layers[0].mlp.down_proj.weight_scale_inv.shape) == (1, 3)
    # transformers' dequantisation takes whole blocks only: the twin holds the same float32 weights.
    reference = hf_reference(quantized, twin, SCHEME, read_quantized=False)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(_logits(model, mc, prompt), expected, **TOLERANCE)


def test_modules_to_not_convert_stay_dense(tmp_path, prompt):
    # transformers' field and matching: "model.layers.1.mlp" leaves layer 1's gate, up and down in float.
    quantized, twin = make_quantized_checkpoint(tmp_path, SCHEME)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.1.mlp"]
    (quantized / "config.json").write_text(json.dumps(config))
    float_weights = load_file(str(next(twin.glob("*.safetensors"))))

    def densify(tensors):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.1.mlp.{proj}"
            tensors.pop(f"{name}.weight_scale_inv")
            tensors[f"{name}.weight"] = float_weights[f"{name}.weight"]

    _rewrite(quantized, densify)
    mc = load_model_config(quantized)
    model = load_model(mc)
    assert not isinstance(model.layers[1].mlp.gate_up_proj, BlockFp8Linear)
    assert isinstance(model.layers[1].self_attn.qkv_proj, BlockFp8Linear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, BlockFp8Linear)
    with torch.no_grad():
        expected = hf_reference(quantized, twin, SCHEME)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(_logits(model, mc, prompt), expected, **TOLERANCE)


def _rewrite(directory, edit) -> None:
    [file] = directory.glob("*.safetensors")
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_weight_scale_inv_is_named(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, SCHEME)
    _rewrite(quantized, lambda t: t.pop("model.layers.1.mlp.gate_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.mlp\.gate_proj\.weight_scale_inv"):
        load_model(quantized)


def test_wrong_scale_grid_is_named(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, SCHEME)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _rewrite(quantized, lambda t: t.update({name: torch.ones(2, 2)}))
    with pytest.raises(ValueError, match=r"o_proj\.weight_scale_inv has shape \(2, 2\), expected \(1, 1\)"):
        load_model(quantized)


def test_float_weight_is_named(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, SCHEME)
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(quantized, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(ValueError, match=r"q_proj\.weight has dtype torch.float32, expected torch.float8_e4m3fn"):
        load_model(quantized)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    # Qwen3-MoE: 4 experts of 48 rows (a partial 128-row block each), top 2.
    return make_quantized_checkpoint(tmp_path_factory.mktemp("moe"), SCHEME, "qwen3-moe")


def test_moe_experts_stay_fp8_with_their_block_scales(moe_checkpoint):
    quantized, _ = moe_checkpoint
    model = load_model(quantized, dtype="bfloat16")
    moe = model.layers[0].mlp
    experts = moe.block_fp8_experts
    assert moe.w13 is None and moe.w2 is None  # no float copy of the experts
    assert (experts.w13.dtype, experts.w2.dtype) == (FP8_DTYPE, FP8_DTYPE)
    assert (experts.w13_scale.dtype, tuple(experts.w13_scale.shape)) == (torch.float32, (4 * 2, 1))
    assert tuple(experts.w2_scale.shape) == (4, 1)
    assert moe.gate.weight.dtype == torch.bfloat16  # the router stays dense
    assert isinstance(model.layers[0].self_attn.qkv_proj, BlockFp8Linear)
    stored = load_file(str(next(quantized.glob("*.safetensors"))))
    name = "model.layers.1.mlp.experts.2"
    # Expert 2's up rows: scale row 2 * 2 + 1 of the stacked scales, weight rows 2 * 128 on of w2.
    layer1 = model.layers[1].mlp.block_fp8_experts
    assert torch.equal(layer1.w13_scale[5:6], stored[f"{name}.up_proj.weight_scale_inv"])
    assert torch.equal(layer1.w2[2 * 128 : 3 * 128].float(), stored[f"{name}.down_proj.weight"].float())


def test_moe_logits_equal_transformers_on_the_same_checkpoint(moe_checkpoint, prompt):
    quantized, twin = moe_checkpoint
    mc = load_model_config(quantized)
    with torch.no_grad():
        expected = hf_reference(quantized, twin, SCHEME)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(_logits(load_model(mc), mc, prompt), expected, **TOLERANCE)


# Qwen3-MoE; Qwen2-MoE's gated shared expert; GLM-4.5's shared experts, router bias and first dense
# layer; Mixtral's w1/w3/w2 experts.
@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe", "glm4-moe", "mixtral"])
def test_moe_greedy_equals_transformers_on_the_same_checkpoint(family, prompt, tmp_path):
    quantized, twin = make_quantized_checkpoint(tmp_path, SCHEME, family)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_reference(quantized, twin, SCHEME).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None
        )
    engine = LLMEngine(quantized, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    assert all(m.block_fp8_experts is not None for m in engine.runner.model.modules() if isinstance(m, SparseMoE))
    [output] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert output.outputs[0].token_ids == out[0, ids.shape[1] :].tolist()


def test_moe_kernels_equal_the_cpu_reference_under_the_interpreter(moe_checkpoint, prompt, monkeypatch):
    # The GPU path (kernels.moe.block_fp8) run on the CPU under the interpreter gives the reference's logits.
    import os

    from gpuworker.models.quantization import block_fp8_experts

    quantized, _ = moe_checkpoint
    mc = load_model_config(quantized)
    model = load_model(mc)
    expected = _logits(model, mc, prompt)
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    monkeypatch.setattr(block_fp8_experts, "experts_block_fp8_reference", block_fp8_experts.fused_moe_block_fp8)
    torch.testing.assert_close(_logits(model, mc, prompt), expected, rtol=1e-4, atol=1e-4)


def test_moe_dummy_weights_of_the_right_dtypes(moe_checkpoint, prompt):
    quantized, _ = moe_checkpoint
    mc = load_model_config(quantized)
    model = load_model(mc, dtype="bfloat16", load_format="dummy")
    assert model.layers[0].mlp.block_fp8_experts.w2.dtype == FP8_DTYPE
    assert torch.isfinite(_logits(model, mc, prompt)).all()


def test_missing_expert_scale_is_named(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, SCHEME, "qwen3-moe")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    _rewrite(quantized, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=re.escape(name)):
        load_model(quantized)


def test_a_split_that_cuts_a_scale_block_is_refused(checkpoint):
    # 4 heads of 32 over two ranks: 64 query rows each, half a 128-row block of the scales.
    from gpuworker.models.tensor_parallel import ParallelContext, shard_config

    with pytest.raises(
        ValueError, match=r"num_attention_heads \* head_dim \(128\) .* gives 64 per rank, .*\[128, 128\]"
    ):
        shard_config(load_model_config(checkpoint[0]), ParallelContext(rank=0, world_size=2))


def test_dummy_weights_of_the_right_dtypes(checkpoint, prompt):
    quantized, _ = checkpoint
    mc = load_model_config(quantized)
    model = load_model(mc, dtype="bfloat16", load_format="dummy")
    down = model.layers[0].mlp.down_proj
    assert (down.weight_fp8.dtype, down.weight_scale_inv.dtype) == (FP8_DTYPE, torch.float32)
    assert torch.isfinite(_logits(model, mc, prompt)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_cuda_moe_layers_equal_their_cpu_reference(moe_checkpoint, tokens):
    # bfloat16: the block FP8 MoE kernels (16-row blocks for a few pairs an expert, 64 beyond) and the
    # block FP8 GEMM of the attention projections against the CPU's per-call dequantised reference.
    quantized, _ = moe_checkpoint
    cpu = load_model(quantized, dtype="bfloat16")
    gpu = load_model(quantized, device="cuda", dtype="bfloat16")
    x = torch.randn(tokens, cpu.config.hidden_size, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    with torch.no_grad():
        for name in ("layers.0.mlp", "layers.1.mlp", "layers.1.self_attn.qkv_proj"):
            expected = cpu.get_submodule(name)(x)
            got = gpu.get_submodule(name)(x.cuda()).cpu()
            torch.testing.assert_close(got, expected, rtol=5e-2, atol=5e-2)
