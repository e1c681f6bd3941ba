"""GPTQ's layout (AutoGPTQ / GPTQModel, checkpoint_format "gptq", desc_act false), unpacked into
plain values.

qweight int32 [in / 8, out]: nibble j of word i holds input row 8i + j (our kernel layout already).
qzeros int32 [in / group, out / 8]: nibble j of word c holds column 8c + j, stored as zero - 1
(symmetric checkpoints store 7 for 8); readers add 1 back, so a stored 15 means 16 (the format's
known overflow of an asymmetric zero of 0). scales float16 [in / group, out]; g_idx int32 [in], when
present, must be the trivial row // group (act-order is not supported). The weight is
(q - zero) * scale.
"""

from __future__ import annotations

import torch

from gpuworker.kernels.quant.int4_matmul import unpack_rows
from gpuworker.models.quantization.int4_checkpoint import check_tensors

FIELDS = ("qweight", "qzeros", "scales")
OPTIONAL_FIELDS = ("g_idx",)


def unpack(
    tensors: dict[str, torch.Tensor], in_features: int, out_features: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_tensors(
        tensors,
        qweight_shape=(in_features // 8, out_features),
        in_features=in_features,
        out_features=out_features,
        group_size=group_size,
    )
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        trivial = torch.arange(in_features, dtype=torch.int64, device=g_idx.device) // group_size
        if tuple(g_idx.shape) != (in_features,) or not torch.equal(g_idx.to(torch.int64), trivial):
            raise ValueError("g_idx is not row // group_size: act-order checkpoints are not supported")
    # The columns of qzeros are packed in plain order: unpack_rows on the transpose.
    stored = unpack_rows(tensors["qzeros"].t().contiguous()).t()
    zeros = (stored + 1).to(torch.uint8)
    return unpack_rows(tensors["qweight"]), zeros, tensors["scales"]
