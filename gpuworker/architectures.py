"""The checkpoint architectures the engine serves, named as config.json names them, and what each
serves as: chat (a decoder), vision (a decoder with an image tower) or embedding (an encoder).
Pure Python, outside gpuworker.models (whose package imports torch), so the daemon can say what a
checkpoint is before any replica loads it; models.config holds each decoder family's layout."""

from __future__ import annotations

from typing import Any

CHAT, VISION, EMBEDDING = "chat", "vision", "embedding"

DECODERS: dict[str, str] = {
    "LlamaForCausalLM": CHAT,
    "MistralForCausalLM": CHAT,
    "Qwen2ForCausalLM": CHAT,
    "Qwen3ForCausalLM": CHAT,
    "MixtralForCausalLM": CHAT,
    "Qwen2MoeForCausalLM": CHAT,
    "Qwen3MoeForCausalLM": CHAT,
    "Glm4MoeForCausalLM": CHAT,
    "DeepseekV2ForCausalLM": CHAT,
    "DeepseekV3ForCausalLM": CHAT,
    "Gemma3ForCausalLM": CHAT,
    "Qwen2_5_VLForConditionalGeneration": VISION,
    "Gemma3ForConditionalGeneration": VISION,
}
# A config.json without `architectures` is read by its model_type.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}
# BERT-family encoders, served by /v1/embeddings (engine.embedding_engine.is_sentence_encoder).
ENCODER = "BertModel"
ENCODER_MODEL_TYPE = "bert"


def served_architecture(config: dict[str, Any]) -> tuple[str, str] | None:
    """(architecture, kind) the engine serves a config.json as; None when it serves none of them."""
    if config.get("model_type") == ENCODER_MODEL_TYPE or ENCODER in (config.get("architectures") or []):
        return ENCODER, EMBEDDING
    names = config.get("architectures") or []
    if not names and config.get("model_type") in MODEL_TYPES:
        names = [MODEL_TYPES[config["model_type"]]]
    for name in names if isinstance(names, list) else []:
        if name in DECODERS:
            return name, DECODERS[name]
    return None


def supported_names() -> str:
    return ", ".join([*DECODERS, ENCODER])
