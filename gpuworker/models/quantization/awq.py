"""AWQ's GEMM layout (AutoAWQ, version "gemm"), unpacked into plain values.

qweight int32 [in, out / 8] and qzeros int32 [in / group, out / 8] pack eight output columns per
word in AWQ's interleaved order: nibble i (bits 4i..4i+3) of word c holds column 8c + ORDER[i].
scales float16 [in / group, out]. The weight is (q - zero) * scale.
"""

from __future__ import annotations

import torch

from gpuworker.models.quantization.int4_checkpoint import check_tensors

FIELDS = ("qweight", "qzeros", "scales")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's order -> int32 values 0..15 [R, C]."""
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C / 8, nibble]
    columns = torch.empty_like(nibbles)
    columns[..., list(ORDER)] = nibbles  # nibble i -> column ORDER[i] of its word
    return columns.reshape(packed.shape[0], -1)


def unpack(
    tensors: dict[str, torch.Tensor], in_features: int, out_features: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_tensors(
        tensors,
        qweight_shape=(in_features, out_features // 8),
        in_features=in_features,
        out_features=out_features,
        group_size=group_size,
    )
    zeros = unpack_columns(tensors["qzeros"]).to(torch.uint8)
    return unpack_columns(tensors["qweight"]), zeros, tensors["scales"]
