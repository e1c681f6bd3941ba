"""Model families for the engine: llama-style decoders (Llama 1/2/3/3.1, Mistral, Qwen2, Qwen3)."""

from gpuworker.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from gpuworker.models.llama import LlamaForCausalLM
from gpuworker.models.loader import load_model, load_model_config, load_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "load_model",
    "load_model_config",
    "load_tokenizer",
]
