"""Fused SiLU-and-multiply of the gated MLP: out = silu(gate) * up, from the fused gate_up output.

One read of [T, 2I] and one write of [T, I] instead of eager torch's three kernels (silu, the
strided split, the product). Numerics follow transformers' Llama MLP in the activation dtype: silu
is computed in float32 and rounded, then the product is rounded again.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gpuworker.kernels.launch import FLOAT_DTYPES, check_tensor, lazy_jit, pdl_options

# Columns one program handles; a row of Llama-3-8B's 14336 takes 14 programs.
BLOCK = 1024


def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options: wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + INTERMEDIATE + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    activated = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * INTERMEDIATE + cols, out.to(gate.dtype), mask=mask)


_silu_and_mul = lazy_jit(_silu_and_mul_kernel)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, last dim contiguous) -> silu(gate) * up [T, I], contiguous."""
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got {width}")
    if gate_up.stride(1) != 1:
        raise ValueError("gate_up's last dimension must be contiguous")
    intermediate = width // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    _silu_and_mul[(num_tokens, -(-intermediate // BLOCK))](
        gate_up, out, gate_up.stride(0), INTERMEDIATE=intermediate, BLOCK=BLOCK, num_warps=4,
        **pdl_options(gate_up.device))
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure torch, as transformers' LlamaMLP computes act_fn(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
