"""What AWQ's and GPTQ's int4 checkpoints share (awq.py and gptq.py unpack each): qweight int32 in
the format's own packing, qzeros int32 [in / group, out / 8] and scales float16 [in / group, out].
A module of its own because int4.py imports both format modules.
"""

from __future__ import annotations

import torch


def check_tensors(
    tensors: dict[str, torch.Tensor],
    *,
    qweight_shape: tuple[int, int],
    in_features: int,
    out_features: int,
    group_size: int,
) -> None:
    """A ValueError naming the first of qweight, qzeros and scales of the wrong shape or dtype."""
    groups = in_features // group_size
    expected = {
        "qweight": (qweight_shape, torch.int32),
        "qzeros": ((groups, out_features // 8), torch.int32),
        "scales": ((groups, out_features), torch.float16),
    }
    for field, (shape, dtype) in expected.items():
        tensor = tensors[field]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{field} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}")
