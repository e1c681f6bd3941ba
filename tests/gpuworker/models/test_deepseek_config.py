"""DeepSeek-V2/V3 config.json parsing: the latent attention shapes, YaRN as transformers computes it
(rotary frequencies, the cos/sin attention factor, mscale_all_dim folded into the softmax scale), the
rotary layout, refusals naming the field, and multi-token-prediction layers skipped at load."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpuworker.models.config import ModelConfig
from gpuworker.models.deepseek.rotary import rope_inv_freq
from gpuworker.models.loader import load_model, load_model_config
from tests.gpuworker.models.deepseek_checkpoints import MLA_TINY, YARN, make_mla_checkpoint


def hf_config(**overrides):
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **MLA_TINY,
        "q_lora_rank": 48,
        **overrides,
    }


def test_parses_the_latent_attention_shapes():
    mc = ModelConfig.from_hf(hf_config())
    mla = mc.mla
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        32,
        48,
        16,
        16,
        24,
    )
    assert mla.rope_interleave and mla.yarn is None
    assert mla.softmax_scale == pytest.approx(32**-0.5)
    assert mc.head_dim == 32 and mc.num_kv_heads == mc.num_heads
    assert ModelConfig.from_hf(hf_config(q_lora_rank=None)).mla.q_lora_rank is None
    assert not ModelConfig.from_hf(hf_config(rope_interleave=False)).mla.rope_interleave


def test_model_type_alone_selects_the_family():
    config = hf_config()
    del config["architectures"]
    assert ModelConfig.from_hf({**config, "model_type": "deepseek_v2"}).architecture == "DeepseekV2ForCausalLM"


def test_llama_configs_have_no_latent_attention():
    from tests.gpuworker.checkpoints import TINY

    mc = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **TINY})
    assert mc.mla is None
    assert mc.kv_cache_layout == (2, TINY["num_key_value_heads"], TINY["hidden_size"] // TINY["num_attention_heads"])


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
def test_missing_field_is_named(field):
    config = hf_config()
    del config[field]
    with pytest.raises(ValueError, match=f"missing required field '{field}'"):
        ModelConfig.from_hf(config, source="ckpt/config.json")


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer"),
        ({"q_lora_rank": "48"}, "q_lora_rank must be a positive integer"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear' is not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            "yarn rope scaling needs 'original_max_position_embeddings'",
        ),
    ],
)
def test_bad_fields_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf_config(**overrides), source="ckpt/config.json")


def test_moe_layers_from_first_k_dense_replace_on():
    mc = ModelConfig.from_hf(
        hf_config(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)
    )
    assert mc.moe.sparse_layers == (False, True)
    assert mc.moe.num_experts == 8 and mc.moe.shared_expert_name == "shared_experts"
    # Every layer dense: no MoE, and the expert fields transformers leaves unset are not needed.
    assert ModelConfig.from_hf(hf_config(num_experts_per_tok=None)).moe is None


@pytest.mark.parametrize("architecture", ["DeepseekV2", "DeepseekV3"])
def test_yarn_matches_transformers(architecture):
    import importlib

    import transformers

    kwargs = {**MLA_TINY, "q_lora_rank": None, "rope_parameters": dict(YARN)}
    hf = getattr(transformers, f"{architecture}Config")(**kwargs)
    package = architecture.lower().replace("deepseekv", "deepseek_v")
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    hf_rotary = getattr(modeling, f"{architecture}RotaryEmbedding")(hf)
    hf_attention = getattr(modeling, f"{architecture}Attention")(hf, 0)
    mla = ModelConfig.from_hf({"architectures": [f"{architecture}ForCausalLM"], **kwargs}).mla
    torch.testing.assert_close(rope_inv_freq(mla), hf_rotary.inv_freq, rtol=0, atol=0)
    assert mla.rotary_scale == pytest.approx(hf_rotary.attention_scaling, rel=1e-12)
    assert mla.softmax_scale == pytest.approx(hf_attention.scaling, rel=1e-12)
    # mscale_all_dim really scales the softmax: 1 + 0.1 ln 4, squared.
    assert mla.softmax_scale == pytest.approx(32**-0.5 * (1 + 0.1 * math.log(4.0)) ** 2)


def test_multi_token_prediction_layers_are_skipped_at_load(tmp_path, caplog):
    path = make_mla_checkpoint(tmp_path, "deepseek-v3")
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    # DeepSeek-V3 stores its MTP module as the layer after the last decoder layer.
    mtp = "model.layers.2."
    tensors[mtp + "eh_proj.weight"] = torch.zeros(64, 128)
    tensors[mtp + "self_attn.kv_b_proj.weight"] = torch.zeros(4 * 40, 32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    mc = load_model_config(path)
    assert mc.extra["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.INFO, logger="gpuworker.models.loader"):
        model = load_model(mc)
    assert len(model.layers) == 2
    assert "skipping multi-token-prediction layer(s) 2 (2 tensors)" in caplog.text


def test_a_stray_tensor_below_num_hidden_layers_is_still_refused(tmp_path):
    path = make_mla_checkpoint(tmp_path, "deepseek-v2")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.eh_proj.weight"] = torch.zeros(4)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensors not used by DeepseekV2ForCausalLM: model.layers.1.eh_proj"):
        load_model(load_model_config(path))
