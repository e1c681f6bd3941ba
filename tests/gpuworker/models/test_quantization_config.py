"""QuantConfig from config.json's quantization_config: the layouts served, and a clear ValueError
naming the field for those that are not."""

from __future__ import annotations

import pytest

from gpuworker.checkpoint_quantization import QuantConfig, parse_quantization
from gpuworker.models.config import ModelConfig
from tests.gpuworker.quantized_checkpoints import SCHEMES, quantization_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def parse(qc):
    return parse_quantization({"quantization_config": qc}, "config.json")


@pytest.mark.parametrize(
    "scheme, expected",
    [
        ("fp8-ct-channel-weight-only", ("fp8", "compressed-tensors", "channel", None)),
        ("fp8-ct-channel-dynamic", ("fp8", "compressed-tensors", "channel", "dynamic")),
        ("fp8-ct-tensor-static", ("fp8", "compressed-tensors", "tensor", "static")),
        ("fp8-vllm-static", ("fp8", "fp8", "tensor", "static")),
        ("fp8-vllm-dynamic", ("fp8", "fp8", "tensor", "dynamic")),
    ],
)
def test_fp8_layouts(scheme, expected):
    quant = parse(quantization_config(scheme))
    assert (quant.method, quant.checkpoint_format, quant.weight_strategy, quant.activation_scheme) == expected
    assert quant.label == "fp8"


@pytest.mark.parametrize(
    "scheme, strategy", [("int8-ct-channel-dynamic", "channel"), ("int8-ct-tensor-dynamic", "tensor")]
)
def test_int8_layouts(scheme, strategy):
    quant = parse(quantization_config(scheme))
    assert (quant.method, quant.checkpoint_format, quant.weight_strategy, quant.activation_scheme) == (
        "int8",
        "compressed-tensors",
        strategy,
        "dynamic",
    )
    assert quant.label == "int8" and quant.ignores("lm_head")


def _int8_with(part: str, **changes):
    qc = quantization_config("int8-ct-channel-dynamic")
    group = qc["config_groups"]["group_0"]
    group[part] = None if changes.get("absent") else {**group[part], **changes}
    return qc


@pytest.mark.parametrize(
    "qc, match",
    [
        (_int8_with("weights", num_bits=4), "weights must be 8-bit int"),
        (_int8_with("weights", strategy="group"), "weights.strategy must be static"),
        (_int8_with("weights", symmetric=False), "weights must be symmetric"),
        (_int8_with("input_activations", dynamic=False, strategy="tensor"), "quantized per 'token' at run time"),
        (_int8_with("input_activations", symmetric=False), "input_activations must be symmetric"),
        (_int8_with("input_activations", absent=True), "input_activations must be symmetric 8-bit int"),
    ],
)
def test_unsupported_int8_layouts_are_named(qc, match):
    with pytest.raises(ValueError, match=match):
        parse(qc)


@pytest.mark.parametrize("scheme, zero_point", [("awq", True), ("gptq-sym", False), ("gptq-asym", True)])
def test_int4_layouts(scheme, zero_point):
    quant = parse(quantization_config(scheme))
    assert (quant.bits, quant.group_size, quant.zero_point) == (4, 128, zero_point)
    assert quant.label == f"{scheme.split('-')[0]}-int4"


def test_model_config_carries_it():
    assert ModelConfig.from_hf(BASE).quantization is None
    mc = ModelConfig.from_hf({**BASE, "quantization_config": quantization_config("awq")})
    assert mc.quantization == parse(quantization_config("awq"))


def test_ignore_patterns():
    quant = QuantConfig(
        method="fp8", checkpoint_format="compressed-tensors", ignore=("lm_head", "re:.*self_attn\\.o_proj")
    )
    assert quant.ignores("lm_head")
    assert quant.ignores("model.layers.3.self_attn.o_proj")
    assert not quant.ignores("model.layers.3.self_attn.q_proj")


@pytest.mark.parametrize(
    "qc, match",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "per-block"}, "activation_scheme"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits must be 4"),
        ({"quant_method": "awq", "bits": 4, "group_size": 100}, "group_size must be a power of two of at least 8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 96}, "group_size must be a power of two of at least 8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
        ("fp8", "must be an object"),
    ],
)
def test_unsupported_layouts_are_named(qc, match):
    with pytest.raises(ValueError, match=match):
        parse(qc)


def test_block_fp8_layout():
    quant = parse(quantization_config("fp8-block"))
    assert (quant.method, quant.weight_strategy, quant.activation_scheme) == ("fp8", "block", "dynamic")
    assert quant.weight_block_size == (128, 128) and quant.label == "fp8"
    # Other block shapes the kernel steps over; modules_to_not_convert as transformers names them.
    quant = parse({"quant_method": "fp8", "weight_block_size": [96, 64], "modules_to_not_convert": ["lm_head"]})
    assert quant.weight_block_size == (96, 64) and quant.ignores("lm_head")


@pytest.mark.parametrize(
    "key, name, skipped",
    [
        # From the start up to a module boundary, as transformers' should_convert_module matches.
        ("model.layers.1", "model.layers.1.mlp.down_proj", True),
        ("model.layers.1", "model.layers.11.mlp.down_proj", False),
        ("model.layers.1.mlp", "model.layers.1.mlp.gate_proj", True),
        ("model.layers.[0-3].self_attn", "model.layers.2.self_attn.q_proj", True),
        ("model.layers.[0-3].self_attn", "model.layers.5.self_attn.q_proj", False),
        # Or as a plain suffix.
        ("down_proj", "model.layers.7.mlp.down_proj", True),
        ("mlp.gate", "model.layers.7.mlp.gate_proj", False),
        ("mlp.gate", "model.layers.7.mlp.gate", True),
    ],
)
def test_block_fp8_modules_to_not_convert_match_as_transformers_does(key, name, skipped):
    from transformers.quantizers.quantizers_utils import should_convert_module

    assert should_convert_module(name, [key]) is not skipped  # the reference says so too
    quant = parse({**BLOCK, "modules_to_not_convert": [key]})
    assert quant.ignores(name) is skipped


BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    "change, match",
    [
        ({"fmt": "e5m2"}, r"quantization_config\.fmt 'e5m2' is not supported"),
        ({"activation_scheme": "static"}, r"quantization_config\.activation_scheme must be 'dynamic'"),
        ({"weight_block_size": [128, 100]}, r"quantization_config\.weight_block_size columns must be a power of two"),
        ({"weight_block_size": [128, 512]}, r"quantization_config\.weight_block_size columns .* got 512"),
        ({"weight_block_size": [128]}, r"quantization_config\.weight_block_size must be two positive integers"),
        ({"weight_block_size": [0, 128]}, r"quantization_config\.weight_block_size must be two positive integers"),
        ({"weight_block_size": "128x128"}, r"quantization_config\.weight_block_size must be two positive integers"),
        ({"scale_fmt": "ue8m0"}, r"quantization_config\.scale_fmt 'ue8m0' is not supported"),
        ({"modules_to_not_convert": "lm_head"}, r"quantization_config\.modules_to_not_convert must be a list"),
    ],
)
def test_unsupported_block_fp8_variants_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        parse({**BLOCK, **change})


def test_compressed_tensors_activation_strategies_are_checked():
    qc = quantization_config("fp8-ct-channel-dynamic")
    qc["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor"  # dynamic per tensor
    with pytest.raises(ValueError, match="dynamic scales must be per 'token'"):
        parse(qc)
    qc = quantization_config("fp8-ct-tensor-static")
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(ValueError, match="weights must be 8-bit float"):
        parse(qc)


def test_every_test_scheme_parses():
    assert all(parse(quantization_config(scheme)) is not None for scheme in SCHEMES)
