"""ModelConfig parsing: the families, both rope formats, EOS ids, and clear rejections."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from gpuworker.models.config import ModelConfig
from gpuworker.models.layers import rope_inv_freq
from gpuworker.models.loader import load_model_config
from tests.gpuworker.checkpoints import make_checkpoint

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
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def parse(**fields) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, **fields})


@pytest.mark.parametrize(
    "family, expected",
    [
        ("llama", dict(attention_bias=False, o_proj_bias=False, qk_norm=False, tie_word_embeddings=False)),
        ("llama-bias", dict(attention_bias=True, o_proj_bias=True, mlp_bias=True)),
        ("qwen2", dict(architecture="Qwen2ForCausalLM", attention_bias=True, o_proj_bias=False)),
        (
            "qwen3",
            dict(
                architecture="Qwen3ForCausalLM",
                head_dim=32,
                qk_norm=True,
                attention_bias=False,
                tie_word_embeddings=True,
            ),
        ),
        (
            "mistral",
            dict(architecture="MistralForCausalLM", rope_theta=1e6, sliding_window=4096, max_position_embeddings=1024),
        ),
        ("llama3.1", dict(rope_theta=500000.0, eos_token_ids=[257, 260])),
    ],
)
def test_families_from_saved_checkpoints(tmp_path, family, expected):
    mc = load_model_config(make_checkpoint(tmp_path, family))
    for name, value in expected.items():
        assert getattr(mc, name) == value, name
    assert (mc.num_heads, mc.num_kv_heads, mc.num_layers) == (4, 2, 2)
    assert mc.model_path == str(tmp_path / family)


def test_transformers_4_rope_fields_and_5_rope_parameters_agree():
    old = parse(
        rope_theta=500000.0, rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}
    )
    new = parse(rope_parameters={"rope_theta": 500000.0, **LLAMA3})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling == LLAMA3
    assert parse().rope_theta == 10000.0 and parse().rope_scaling is None


def test_llama3_original_context_defaults_to_max_position_embeddings():
    scaling = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert parse(rope_parameters=scaling).rope_scaling["original_max_position_embeddings"] == 1024


def test_llama3_inverse_frequencies_equal_transformers():
    hf_config = LlamaConfig(
        **{k: v for k, v in BASE.items() if k != "architectures"}, rope_parameters={"rope_theta": 500000.0, **LLAMA3}
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    ours = rope_inv_freq(16, 500000.0, LLAMA3)
    assert torch.equal(ours, expected)
    plain = rope_inv_freq(16, 500000.0, None)
    # The low-frequency end is slowed by the factor, the high-frequency end is untouched.
    assert ours[0] == plain[0]
    assert math.isclose(ours[-1].item(), plain[-1].item() / 8.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture ['GPT2LMHeadModel']"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear' is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling needs 'low_freq_factor'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
        ({"vocab_size": None}, "missing required field 'vocab_size'"),
        ({"hidden_size": -64}, "hidden_size must be a positive integer"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_rejections_name_the_field(fields, message):
    with pytest.raises(ValueError) as excinfo:
        parse(**fields)
    assert message in str(excinfo.value)
    assert "config.json" in str(excinfo.value)


def test_architecture_falls_back_to_model_type():
    mc = ModelConfig.from_hf({**BASE, "architectures": None, "model_type": "qwen2"})
    assert mc.architecture == "Qwen2ForCausalLM" and mc.attention_bias


def test_eos_ids_merge_config_and_generation_config():
    mc = ModelConfig.from_hf({**BASE, "eos_token_id": 2}, {"eos_token_id": [2, 7, 9]})
    assert mc.eos_token_ids == [2, 7, 9]
    assert ModelConfig.from_hf({**BASE, "eos_token_id": None}).eos_token_ids == []


def test_sliding_window_caps_the_served_context():
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    assert ModelConfig.from_hf({**mistral, "sliding_window": 4096}).max_position_embeddings == 4096
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).max_position_embeddings == 32768
    qwen2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 128}
    # Qwen2 declares a window but only uses it when use_sliding_window is set.
    assert ModelConfig.from_hf(qwen2).max_position_embeddings == 1024
    assert ModelConfig.from_hf({**qwen2, "use_sliding_window": True}).max_position_embeddings == 128


def test_generation_config_is_read_from_the_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert load_model_config(tmp_path).eos_token_ids == [5, 6]


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .* does not exist"):
        load_model_config(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model_config(tmp_path)
