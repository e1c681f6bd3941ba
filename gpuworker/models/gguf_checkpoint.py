"""GGUF checkpoints (llama.cpp's single-file format): config, dequantised weights and tokenizer.

transformers' GGUF support does the mapping: it turns GGUF metadata into a config.json-style dict,
names each GGUF tensor by its Hugging Face parameter and undoes llama.cpp's q/k permutation; the
`gguf` library dequantises the blocks (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants...). The
weights are read one tensor at a time from the memory-mapped file, so a load holds the model plus
one dequantised tensor, never a second copy of the whole model (transformers' own
load_gguf_checkpoint(return_tensors=True) builds the full float32 state dict first).
Which paths are GGUF checkpoints: gpuworker.checkpoint_files.gguf_file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
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


class GGUFTensor(NamedTuple):
    """One weight of the file, not yet read: its Hugging Face name and shape (None for a tensor
    the model has no parameter for, such as llama.cpp's precomputed rope frequencies)."""

    name: str | None
    shape: tuple[int, ...]
    source: Any  # gguf.ReaderTensor: the blocks, a view of the memory-mapped file


class GGUFWeights:
    """The file's tensors under their Hugging Face names, dequantised to float32 one at a time."""

    def __init__(self, file: Path) -> None:
        from gguf import GGUFReader
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            read_field,
        )

        config = read_gguf_config(file)
        reader = GGUFReader(str(file))  # memory-mapped: a tensor's blocks are read when used
        architecture = read_field(reader, "general.architecture")[0]
        # Only the tensors are kept: the reader's parsed metadata (the tokenizer's vocabulary and
        # merges, as small arrays) weighs more than the whole of a small model.
        self.source_tensors = list(reader.tensors)
        del reader
        self.processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
        # The names come from a transformers model's parameter names: a model on the meta device
        # has them without allocating any weight.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        self.hf_names = get_gguf_hf_weights_map(skeleton, self.processor)

    def tensors(self) -> list[GGUFTensor]:
        """Every tensor's name and shape (rows first, as in PyTorch), without reading any block.
        The dense families' processors keep GGUF names, so the map names them up front."""
        return [
            GGUFTensor(self.hf_names.get(t.name), tuple(int(n) for n in reversed(t.shape)), t)
            for t in self.source_tensors
        ]

    def read(self, tensor: GGUFTensor) -> torch.Tensor:
        """`tensor` dequantised to float32 (and un-permuted where llama.cpp permuted it)."""
        from gguf import dequantize

        source = tensor.source
        weights = self.processor.process(
            weights=dequantize(source.data, source.tensor_type),
            name=source.name,
            tensor_key_mapping=self.hf_names,
            parsed_parameters={},
        ).weights
        # An F32 tensor comes back as a read-only view of the mapped file, which torch wraps only
        # with a warning: it is copied (one tensor; the others are fresh arrays already).
        return torch.from_numpy(np.require(weights, requirements="W"))


def load_gguf_tokenizer(file: Path):
    """The tokenizer and chat template stored in the file's metadata."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{file}: could not build the tokenizer from its GGUF metadata: {exc}") from exc
