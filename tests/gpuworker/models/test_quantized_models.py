"""Quantized checkpoints (FP8 compressed-tensors / vLLM fp8 / block-wise FP8, INT8 W8A8, AWQ, GPTQ)
load into quantized linears and give the logits of their dequantised float32 twin run by
transformers (with the format's FP8 or INT8 activation rounding where it has one); FP8 at load;
what a broken or unsupported checkpoint says.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE
from gpuworker.models.loader import load_model, load_model_config
from gpuworker.models.quantization.awq import unpack_columns
from gpuworker.models.quantization.block_fp8 import BlockFp8Linear
from gpuworker.models.quantization.fp8 import Fp8Linear
from gpuworker.models.quantization.int4 import Int4Linear
from gpuworker.models.quantization.int8 import Int8Linear
from tests.gpuworker.models.paged_batch import PagedBatcher
from tests.gpuworker.quantized_checkpoints import SCHEMES, hf_reference, make_quantized_checkpoint

# float32 on both sides, the same dequantised weights: GEMM rounding only.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}


def _logits(model, mc, prompt: list[int]) -> torch.Tensor:
    batcher = PagedBatcher(mc)
    input_ids, positions, meta = batcher.batch([("s", prompt)])
    with torch.no_grad():
        return model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 384, (40,), generator=torch.Generator().manual_seed(5)).tolist()


# INT8 per-token activations have a step of a row's largest magnitude / 127, coarse enough that the
# float32 summation-order noise between the engine and transformers (~1e-6 in a down_proj input)
# moves one activation across a rounding boundary in about one forward pass of this size in two; the
# flipped step then runs through every later layer. Its linears are compared one by one instead
# (test_int8_linears_equal_the_twins_projections) and its greedy tokens end to end
# (tests/gpuworker/engine/test_engine_quantized.py).
FLOAT_EXACT_SCHEMES = sorted(scheme for scheme in SCHEMES if not scheme.startswith("int8"))


@pytest.mark.parametrize("scheme", FLOAT_EXACT_SCHEMES)
def test_logits_equal_the_dequantised_reference(scheme, prompt, tmp_path):
    quantized, twin = make_quantized_checkpoint(tmp_path, scheme)
    mc = load_model_config(quantized)
    model = load_model(mc)
    expected_class = (
        BlockFp8Linear
        if scheme.startswith("fp8-block")
        else Fp8Linear
        if scheme.startswith("fp8")
        else Int8Linear
        if scheme.startswith("int8")
        else Int4Linear
    )
    assert isinstance(model.layers[1].self_attn.qkv_proj, expected_class)
    assert isinstance(model.layers[0].mlp.down_proj, expected_class)
    with torch.no_grad():
        expected = hf_reference(quantized, twin, scheme)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(_logits(model, mc, prompt), expected, **TOLERANCE)


@pytest.mark.parametrize("scheme", ["int8-ct-channel-dynamic", "int8-ct-tensor-dynamic"])
def test_int8_linears_equal_the_twins_projections(scheme, tmp_path):
    # Each fused INT8 projection (its shards' weights and scales) gives what the twin's float32
    # projections give on the input rounded through INT8 per token, as the format says.
    quantized, twin = make_quantized_checkpoint(tmp_path, scheme)
    model = load_model(quantized)
    reference = hf_reference(quantized, twin, scheme).model
    generator = torch.Generator().manual_seed(7)
    for i in range(len(model.layers)):
        layer, twin_layer = model.layers[i], reference.layers[i]
        for linear, parts in (
            (layer.self_attn.qkv_proj, [getattr(twin_layer.self_attn, f"{p}_proj") for p in "qkv"]),
            (layer.self_attn.o_proj, [twin_layer.self_attn.o_proj]),
            (layer.mlp.gate_up_proj, [twin_layer.mlp.gate_proj, twin_layer.mlp.up_proj]),
            (layer.mlp.down_proj, [twin_layer.mlp.down_proj]),
        ):
            assert isinstance(linear, Int8Linear) and linear.weight_int8.dtype == torch.int8
            x = torch.randn(9, linear.in_features, generator=generator) * 3
            with torch.no_grad():
                expected = torch.cat([part(x) for part in parts], dim=-1)  # the hooks round x
                torch.testing.assert_close(linear(x), expected, **TOLERANCE)


def test_int8_asymmetric_zero_points_are_refused(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, "int8-ct-channel-dynamic")

    def add_zero_points(tensors):
        name = "model.layers.0.mlp.down_proj"
        tensors[f"{name}.weight_zero_point"] = torch.ones_like(tensors[f"{name}.weight_scale"], dtype=torch.int8)

    _rewrite(quantized, add_zero_points)
    with pytest.raises(ValueError, match="down_proj.weight_zero_point holds non-zero values"):
        load_model(quantized)


def test_buffers_keep_their_dtypes_in_bfloat16(tmp_path, prompt):
    quantized, _ = make_quantized_checkpoint(tmp_path, "fp8-ct-tensor-static")
    model = load_model(quantized, dtype="bfloat16")
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight_fp8.dtype == FP8_DTYPE
    assert qkv.weight_scale.dtype == qkv.input_scale.dtype == torch.float32
    # q, k and v were calibrated with different static scales: the fused projection takes the largest.
    scales = load_file(str(next(quantized.glob("*.safetensors"))))
    expected = max(scales[f"model.layers.0.self_attn.{p}_proj.input_scale"].item() for p in "qkv")
    assert qkv.input_scale.item() == expected
    assert torch.isfinite(_logits(model, load_model_config(quantized), prompt)).all()


def test_fp8_at_load_quantizes_a_float_checkpoint(tmp_path, prompt):
    # The per-channel, per-token scheme is what quantization="fp8" makes of the float checkpoint the
    # quantized files were made from: the same reference applies.
    quantized, twin = make_quantized_checkpoint(tmp_path, "fp8-ct-channel-dynamic")
    source = quantized.parent / "float" / "llama"
    mc = load_model_config(source)
    model = load_model(mc, quantization="fp8")
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.quant.activation_scheme == "dynamic"
    with torch.no_grad():
        expected = hf_reference(quantized, twin, "fp8-ct-channel-dynamic")(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(_logits(model, mc, prompt), expected, **TOLERANCE)


def test_dummy_weights_of_the_right_dtypes(tmp_path, prompt):
    quantized, _ = make_quantized_checkpoint(tmp_path, "gptq-sym")
    mc = load_model_config(quantized)
    model = load_model(mc, dtype="bfloat16", load_format="dummy")
    down = model.layers[0].mlp.down_proj
    assert (down.qweight.dtype, down.zeros.dtype, down.scales.dtype) == (torch.int32, torch.uint8, torch.float16)
    assert torch.isfinite(_logits(model, mc, prompt)).all()


def test_int8_dummy_weights(tmp_path, prompt):
    # load_format "dummy" (the benchmarks' INT8 rows): int8 weights and float32 scales in a bfloat16 model.
    quantized, _ = make_quantized_checkpoint(tmp_path, "int8-ct-channel-dynamic")
    mc = load_model_config(quantized)
    model = load_model(mc, dtype="bfloat16", load_format="dummy")
    qkv = model.layers[0].self_attn.qkv_proj
    assert (qkv.weight_int8.dtype, qkv.weight_scale.dtype) == (torch.int8, torch.float32)
    assert qkv.weight_int8.abs().amax().item() == 127
    assert torch.isfinite(_logits(model, mc, prompt)).all()


def test_awq_nibble_order():
    # Nibble i of a word holds column ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i].
    word = sum(i << (4 * i) for i in range(8))
    assert unpack_columns(torch.tensor([[word]], dtype=torch.int32)).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


def test_gptq_zero_points_are_stored_minus_one(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, "gptq-sym")
    model = load_model(quantized)
    # Symmetric GPTQ stores 7 for a zero point of 8.
    assert (model.layers[0].self_attn.o_proj.zeros == 8).all()


def _rewrite(directory, edit) -> None:
    [file] = directory.glob("*.safetensors")
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_scale_is_named(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, "fp8-ct-channel-dynamic")
    _rewrite(quantized, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.self_attn\.k_proj\.weight_scale"):
        load_model(quantized)


def test_unexpected_tensor_is_named(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, "awq")
    _rewrite(quantized, lambda t: t.update({"model.layers.0.mlp.up_proj.bias_scale": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.bias_scale: unexpected tensor"):
        load_model(quantized)


def test_wrong_shape_is_named(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, "gptq-asym")
    name = "model.layers.0.mlp.gate_proj.scales"
    _rewrite(quantized, lambda t: t.update({name: t[name][:, :8].contiguous()}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj: scales is torch.float16 \(1, 8\)"):
        load_model(quantized)


# qweight [in, out / 8] in AWQ, [in / 8, out] in GPTQ: the same words in the other format's shape.
@pytest.mark.parametrize(
    ("scheme", "other_shape"),
    [("awq", lambda rows, cols: (rows // 8, cols * 8)), ("gptq-sym", lambda rows, cols: (rows * 8, cols // 8))],
)
def test_the_other_formats_qweight_shape_is_named(scheme, other_shape, tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, scheme)
    name = "model.layers.0.mlp.gate_proj.qweight"
    [file] = quantized.glob("*.safetensors")
    stored = tuple(load_file(str(file))[name].shape)
    wrong = other_shape(*stored)
    _rewrite(quantized, lambda t: t.update({name: t[name].reshape(wrong).contiguous()}))
    with pytest.raises(
        ValueError, match=re.escape(f"gate_proj: qweight is torch.int32 {wrong}, expected torch.int32 {stored}")
    ):
        load_model(quantized)


def test_act_order_is_refused(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, "gptq-sym")
    name = "model.layers.0.self_attn.q_proj.g_idx"

    def permute(tensors):  # input row 0 in another group than row // group_size
        tensors[name] = tensors[name].clone()
        tensors[name][0] = 1

    _rewrite(quantized, permute)
    with pytest.raises(ValueError, match="act-order"):
        load_model(quantized)


def test_fp8_at_load_of_a_quantized_checkpoint_is_refused(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, "fp8-vllm-dynamic")
    with pytest.raises(ValueError, match=r"already quantized \(fp8\)"):
        load_model(quantized, quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(quantized, quantization="int3")


def test_quantized_moe_is_refused(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("qwen3-moe")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_model(path, quantization="fp8")


def test_ignored_modules_stay_dense(tmp_path, prompt):
    quantized, twin = make_quantized_checkpoint(tmp_path, "fp8-ct-channel-weight-only")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*\\.mlp\\.down_proj"]
    (quantized / "config.json").write_text(json.dumps(config))
    _rewrite(
        quantized,
        lambda t: [
            t.update(
                {
                    f"model.layers.{i}.mlp.down_proj.weight": load_file(str(next(twin.glob("*.safetensors"))))[
                        f"model.layers.{i}.mlp.down_proj.weight"
                    ]
                }
            )
            or t.pop(f"model.layers.{i}.mlp.down_proj.weight_scale")
            for i in range(2)
        ],
    )
    model = load_model(quantized)
    assert not isinstance(model.layers[0].mlp.down_proj, Fp8Linear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, Fp8Linear)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16, 17, 256])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_cuda_linears_equal_their_cpu_reference(scheme, rows, tmp_path):
    # bfloat16: FP8 rows >= 17 take torch._scaled_mm, fewer the Triton kernel; INT4 the Triton GEMM.
    # One FP8 row is the GEMV's weight stream, which keeps x unquantized (Fp8Linear.forward): its
    # reference is x times the dequantised weight, not the W8A8 product.
    quantized, _ = make_quantized_checkpoint(tmp_path, scheme)
    cpu = load_model(quantized, dtype="bfloat16")
    gpu = load_model(quantized, device="cuda", dtype="bfloat16")
    generator = torch.Generator().manual_seed(rows)
    for name in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj"):
        reference, linear = cpu.get_submodule(name), gpu.get_submodule(name)
        x = torch.randn(rows, reference.in_features, generator=generator).bfloat16()
        with torch.no_grad():
            expected = reference(x)
            if isinstance(reference, Fp8Linear) and rows == 1:
                weight = reference.weight_fp8.float() * reference.weight_scale[:, None]
                bias = None if reference.bias is None else reference.bias.float()
                expected = torch.nn.functional.linear(x.float(), weight, bias).bfloat16()
            torch.testing.assert_close(linear(x.cuda()).cpu(), expected, rtol=2e-2, atol=2e-2)
