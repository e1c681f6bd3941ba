"""DeepSeek-style MoE (models.config.deepseek_moe_config + models.moe.SparseMoE) against transformers'
DeepSeek-V2, DeepSeek-V3 and GLM-4.5 MoE blocks on the same weights; GLM-4.5's config fields; clear
rejections naming the field; multi-token-prediction layers skipped at load."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gpuworker.models.config import ModelConfig, deepseek_moe_config
from gpuworker.models.loader import load_model, load_model_config
from gpuworker.models.moe import SparseMoE
from tests.gpuworker.checkpoints import make_checkpoint
from tests.gpuworker.models.paged_batch import PagedBatcher

HIDDEN = 32
# (config class, MoE block class, fields)
BLOCKS = {
    "deepseek-v2-greedy": (
        "DeepseekV2Config",
        "deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe",
        {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2, "topk_method": "greedy"},
    ),
    "deepseek-v2-group-limited": (
        "DeepseekV2Config",
        "deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe",
        {
            "n_routed_experts": 16,
            "num_experts_per_tok": 3,
            "n_shared_experts": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 16.0,
        },
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
        {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    ),
    "glm4-moe": (
        "Glm4MoeConfig",
        "glm4_moe.modeling_glm4_moe.Glm4MoeMoE",
        {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": True},
    ),
}


def hf_block(name: str):
    import importlib

    config_name, block_path, fields = BLOCKS[name]
    config = getattr(transformers, config_name)(
        hidden_size=HIDDEN, moe_intermediate_size=24, num_hidden_layers=2, first_k_dense_replace=1, **fields
    )
    module_name, class_name = block_path.rsplit(".", 1)
    block = getattr(importlib.import_module(f"transformers.models.{module_name}"), class_name)(config).eval()
    g = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.3 * torch.randn(bias.shape, generator=g))
    return config.to_dict(), block


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_sparse_moe_equals_transformers_block(name):
    config, block = hf_block(name)
    moe_config = deepseek_moe_config(config)
    assert moe_config.sparse_layers == (False, True)
    with torch.device("meta"):
        ours = SparseMoE(HIDDEN, moe_config)
    ours = ours.to_empty(device="cpu")
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(block.gate.e_score_correction_bias)
        ours.w13.copy_(block.experts.gate_up_proj.flatten(0, 1))
        ours.w2.copy_(block.experts.down_proj.flatten(0, 1))
        shared = block.shared_experts
        ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
    assert ours.shared_expert_gate is None
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), block(x[None])[0], rtol=1e-5, atol=1e-5)


def test_builder_fields_and_transformers_defaults():
    v3 = deepseek_moe_config(
        {
            "model_type": "deepseek_v3",
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
        }
    )
    assert v3.routing.topk_method == "noaux_tc" and v3.routing.scoring_func == "sigmoid"
    assert (v3.routing.n_group, v3.routing.topk_group, v3.routing.scaling, v3.routing.normalize) == (8, 4, 2.5, True)
    assert v3.sparse_layers == (False,) * 3 + (True,) * 58
    assert v3.shared_expert_intermediate_size == 2048 and v3.router_bias and v3.router_float32
    assert v3.shared_expert_name == "shared_experts" and not v3.shared_expert_gated
    v2 = deepseek_moe_config(
        {
            "model_type": "deepseek_v2",
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 27,
            "first_k_dense_replace": 1,
            "scoring_func": "softmax",
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
        }
    )
    assert v2.routing.scoring_func == "softmax" and not v2.router_bias and not v2.routing.normalize
    assert v2.shared_expert_intermediate_size == 2 * 1408 and v2.sparse_layers[:2] == (False, True)


GLM = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "n_group": 2,
    "topk_group": 1,
}


def test_glm_config_transformers_4_layout():
    # GLM-4.5's published config.json: partial_rotary_factor and rope_theta at the top level.
    mc = ModelConfig.from_hf(
        {
            **GLM,
            "partial_rotary_factor": 0.5,
            "rope_theta": 1e6,
            "use_qk_norm": True,
            "attention_bias": True,
            "num_nextn_predict_layers": 1,
        }
    )
    assert (mc.rotary_dim, mc.rotary_width, mc.rope_theta, mc.qk_norm) == (16, 16, 1e6, True)
    assert mc.attention_bias and not mc.o_proj_bias
    assert mc.moe.sparse_layers == (False, True, True) and mc.moe.routing.topk_group == 1
    assert mc.extra["num_nextn_predict_layers"] == 1
    # Without the field, transformers' GLM default of half the head.
    assert ModelConfig.from_hf(GLM).rotary_dim == 16
    assert ModelConfig.from_hf({**GLM, "partial_rotary_factor": 1.0}).rotary_dim is None
    assert not ModelConfig.from_hf(GLM).qk_norm


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"topk_group": 3}, "topk_group"),
        ({"n_group": 3}, "n_group"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"scoring_func": "tanh"}, "scoring_func"),
        ({"topk_method": "top1"}, "topk_method"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"first_k_dense_replace": 4}, "first_k_dense_replace"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"n_routed_experts": None}, "n_routed_experts"),
        ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ],
)
def test_glm_rejections_name_the_field(fields, field):
    with pytest.raises(ValueError, match=field) as excinfo:
        ModelConfig.from_hf({**GLM, **fields})
    assert "config.json" in str(excinfo.value)


def test_deepseek_v2_renormalisation_and_unknown_model_types_are_refused():
    v2 = {
        "model_type": "deepseek_v2",
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 2,
    }
    with pytest.raises(ValueError, match="norm_topk_prob"):
        deepseek_moe_config({**v2, "norm_topk_prob": True})
    with pytest.raises(ValueError, match="model_type"):
        deepseek_moe_config({**v2, "model_type": "mixtral"})


def test_prediction_layers_are_skipped_with_a_log_line(tmp_path, caplog):
    path = make_checkpoint(tmp_path, "glm4-moe")
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    tensors = load_file(str(path / "model.safetensors"))
    prompt = list(range(5, 30))
    mc = load_model_config(path)

    def logits():
        model = load_model(load_model_config(path))
        batcher = PagedBatcher(mc)
        input_ids, positions, meta = batcher.batch([("s", prompt)])
        with torch.no_grad():
            return model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta))

    before = logits()
    # The MTP layer as GLM-4.5 ships it: a whole decoder layer after the last, plus its own heads.
    layer = mc.num_layers
    extra = {
        name.replace("model.layers.1.", f"model.layers.{layer}."): t.clone()
        for name, t in tensors.items()
        if name.startswith("model.layers.1.")
    }
    extra[f"model.layers.{layer}.eh_proj.weight"] = torch.zeros(64, 128)
    extra[f"model.layers.{layer}.shared_head.norm.weight"] = torch.ones(64)
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="gpuworker.models.loader"):
        after = logits()
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert any("multi-token-prediction layer(s) 2" in record.getMessage() for record in caplog.records)
    # A layer beyond them is still an unexpected tensor.
    save_file(
        {**tensors, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match="model.layers.3.eh_proj.weight"):
        load_model(load_model_config(path))


def test_router_stays_float32_in_a_bfloat16_model(tmp_path):
    path = make_checkpoint(tmp_path, "glm4-moe", dtype="bfloat16")
    model = load_model(load_model_config(path), dtype="auto")
    moe = model.layers[1].mlp
    assert model.embed_tokens.dtype == torch.bfloat16 and moe.w13.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    torch.testing.assert_close(moe.e_score_correction_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    prompt = torch.randint(0, 384, (40,), generator=torch.Generator().manual_seed(0))
    batcher = PagedBatcher(model.config, dtype=torch.bfloat16)
    input_ids, positions, meta = batcher.batch([("s", prompt.tolist())])
    with torch.no_grad():
        ours = model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta))
        reference = hf(prompt[None]).logits[0].float()
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
