"""The FP8 KV cache's static scales a checkpoint may carry: one scalar per layer for keys and one for
values, `model.layers.N.self_attn.k_scale` / `.v_scale`, as llm-compressor writes them for a
`kv_cache_scheme` (compressed-tensors) and vLLM reads them. A layer without them keeps 1.0; a cache of
the model's dtype ignores them (gpuworker.kernels.quant.kv_cache).
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from gpuworker.kernels.quant.kv_cache import check_kv_scale

KV_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def is_kv_scale(name: str, num_layers: int) -> bool:
    match = KV_SCALE_NAME.fullmatch(name)
    return match is not None and int(match.group(1)) < num_layers


def load_kv_scales(layers: nn.ModuleList, entries: list[tuple[Path, str]]) -> None:
    """Set each named layer's attention k_scale / v_scale (floats, fixed for the model's life) from
    the checkpoint tensors (file, name)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for file, name in entries:
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():  # each file opened once
        with safe_open(str(file), framework="pt") as reader:
            for name in names:
                tensor = reader.get_tensor(name)
                if tensor.numel() != 1:
                    raise ValueError(
                        f"{name} in {file.name} must hold one scale (a per-tensor KV cache scale), "
                        f"got shape {tuple(tensor.shape)}"
                    )
                match = KV_SCALE_NAME.fullmatch(name)
                attn = layers[int(match.group(1))].self_attn
                setattr(attn, f"{match.group(2)}_scale", check_kv_scale(name, float(tensor.float().item())))
