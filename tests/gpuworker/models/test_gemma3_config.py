"""Gemma 3's config layout: both config.json formats (transformers 5's layer_types and
rope_parameters per layer type; the older sliding_window_pattern, rope_local_base_freq and
rope_scaling), the window not capping the context, and clear rejections naming the field."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from gpuworker.models.config import ModelConfig
from gpuworker.models.layers import rope_inv_freq

BASE = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 131072,
    "sliding_window": 512,
}


def parse(**fields) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, **fields})


def test_transformers_written_config():
    config = Gemma3TextConfig(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")})
    mc = ModelConfig.from_hf({**config.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    assert mc.architecture == "Gemma3ForCausalLM" and mc.tie_word_embeddings
    # Five sliding layers, then a full one (transformers' default pattern of 6).
    assert mc.layer_windows == (512, 512, 512, 512, 512, None)
    # The window does not cap the context: the sliding layers attend through it.
    assert mc.max_position_embeddings == 131072 and mc.sliding_window is None
    layout = mc.gemma3
    assert (layout.rope_theta, layout.local_rope_theta, layout.rope_scaling) == (1_000_000.0, 10_000.0, None)
    assert layout.query_pre_attn_scalar == 256 and layout.final_logit_softcapping is None
    assert mc.qk_norm and not mc.attention_bias


def test_model_type_alone_names_the_family():
    mc = ModelConfig.from_hf({**BASE, "architectures": None})
    assert mc.architecture == "Gemma3ForCausalLM"


def test_older_layout_with_pattern_local_base_and_linear_scaling():
    mc = parse(
        sliding_window_pattern=3,
        rope_theta=500000.0,
        rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=48,
        final_logit_softcapping=30.0,
    )
    assert mc.layer_windows == (512, 512, None, 512, 512, None)
    layout = mc.gemma3
    assert layout.rope_theta == 500000.0 and layout.local_rope_theta == 20000.0
    assert layout.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert layout.query_pre_attn_scalar == 48.0 and layout.final_logit_softcapping == 30.0


def test_linear_rope_matches_transformers():
    config = Gemma3TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    mc = ModelConfig.from_hf({**config.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    hf = Gemma3RotaryEmbedding(config)
    ours_full = rope_inv_freq(32, mc.gemma3.rope_theta, mc.gemma3.rope_scaling)
    ours_local = rope_inv_freq(32, mc.gemma3.local_rope_theta, None)
    assert torch.equal(ours_full, hf.full_attention_inv_freq)
    assert torch.equal(ours_local, hf.sliding_attention_inv_freq)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention"] * 5}, "layer_types"),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "rope_type"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding_attention"),
        ({"rope_parameters": {"global": {"rope_type": "default"}}}, "rope_parameters"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ],
)
def test_bad_fields_are_refused_by_name(fields, field):
    with pytest.raises(ValueError, match=field):
        parse(**fields)
