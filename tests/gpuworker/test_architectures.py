"""The torch-free list of served architectures agrees with the model families the engine builds."""

import pytest

from gpuworker.architectures import DECODERS, EMBEDDING, ENCODER, MODEL_TYPES, VISION, served_architecture
from gpuworker.models import config as model_config


def test_every_decoder_family_is_listed_with_its_kind():
    assert set(DECODERS) == set(model_config.SUPPORTED_ARCHITECTURES)
    vision = {name for name, family in model_config._FAMILIES.items() if family.get("vision")}
    assert {name for name, kind in DECODERS.items() if kind == VISION} == vision
    assert set(MODEL_TYPES.values()) <= set(DECODERS)


@pytest.mark.parametrize(
    ("config", "served"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, ("LlamaForCausalLM", "chat")),
        ({"model_type": "qwen2"}, ("Qwen2ForCausalLM", "chat")),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, ("Gemma3ForConditionalGeneration", "vision")),
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, (ENCODER, EMBEDDING)),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, None),
        ({"architectures": "LlamaForCausalLM"}, None),
        ({}, None),
    ],
)
def test_a_config_is_served_as(config, served):
    assert served_architecture(config) == served
