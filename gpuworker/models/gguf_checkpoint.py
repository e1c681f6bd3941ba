"""GGUF checkpoints (llama.cpp's single-file format): config, dequantised weights and tokenizer.

transformers' GGUF reader does the work: it maps GGUF metadata to a config.json-style dict, undoes
llama.cpp's q/k permutation and dequantises every tensor with the `gguf` library (F32, F16, BF16,
Q8_0, Q4_0, Q4_1, the K-quants...), so the names it returns are the Hugging Face ones our loader
already maps. Which paths are GGUF checkpoints: gpuworker.checkpoint_files.gguf_file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def read_gguf_config(file: Path) -> dict[str, Any]:
    """The file's metadata as a config.json dict (model_type, sizes, rope, token ids)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        parsed = load_gguf_checkpoint(str(file), return_tensors=False)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{file}: not a readable GGUF checkpoint: {exc}") from exc
    config = dict(parsed["config"])
    # GGUF stores dequantisable blocks, not a serving dtype; float32 is what dequantisation yields.
    config.setdefault("torch_dtype", "float32")
    return config


def read_gguf_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every weight of the file, dequantised to float32, under its Hugging Face name."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The reader maps GGUF names through a transformers model's parameter names: a model on the
    # meta device has them without allocating any weight.
    hf_config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    return load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=skeleton)["tensors"]


def load_gguf_tokenizer(file: Path):
    """The tokenizer and chat template stored in the file's metadata."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{file}: could not build the tokenizer from its GGUF metadata: {exc}") from exc
