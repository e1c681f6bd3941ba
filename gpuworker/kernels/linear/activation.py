"""Fused SiLU-and-multiply of the gated MLP: out = silu(gate) * up, from the fused gate_up output.

One read of [T, 2I] and one write of [T, I] instead of eager torch's three kernels (silu, the
strided split, the product). Numerics follow transformers' Llama MLP in the activation dtype: silu
is computed in float32 and rounded, then the product is rounded again. silu_and_mul_fp8 also
quantizes each row to FP8 for an FP8 down projection (one write of one byte a value, and no
quantizer launch reading the output back). gelu_tanh_and_mul is Gemma's gate (GELU_TANH).
"""

from __future__ import annotations

import torch
import triton.language as tl

from gpuworker.kernels.device import fp8_codec, gated_activation
from gpuworker.kernels.launch import FLOAT_DTYPES, check_tensor, lazy_jit, next_power_of_2, pdl_options
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE

# Columns one program handles; a row of Llama-3-8B's 14336 takes 14 programs.
BLOCK = 1024
# The widest row silu_and_mul_fp8 quantizes in one program (32 values of each half a thread at 16 warps).
MAX_FP8_ROW = 16384


def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    scale_ptr,
    stride_in,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
    GELU_TANH: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options: wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + INTERMEDIATE + cols, mask=mask, other=0.0)
    if GELU_TANH:
        out = gated_activation.gelu_tanh_and_mul(gate, up)
    else:
        out = gated_activation.silu_and_mul(gate, up)
    if FP8_OUT:  # the program holds the whole row (lanes past it are zero): quantized per row here
        q, scale = fp8_codec.quantize_row(out.to(tl.float32))
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * INTERMEDIATE + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * INTERMEDIATE + cols, out, mask=mask)


_silu_and_mul = lazy_jit(_silu_and_mul_kernel)


def silu_and_mul(gate_up: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, last dim contiguous) -> silu(gate) * up [T, I], contiguous
    (gelu_tanh: gelu(gate, approximate="tanh") * up, Gemma's gate)."""
    num_tokens, intermediate = _checked(gate_up)
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        _silu_and_mul[(num_tokens, -(-intermediate // BLOCK))](
            gate_up,
            out,
            out,
            gate_up.stride(0),
            INTERMEDIATE=intermediate,
            BLOCK=BLOCK,
            FP8_OUT=False,
            GELU_TANH=gelu_tanh,
            num_warps=4,
            **pdl_options(gate_up.device),
        )
    return out


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul with its output quantized to FP8 per row in the same launch, the input of an FP8
    down projection: (float8_e4m3fn [T, I], float32 scale [T]), bit for bit quantize_fp8_rows of
    silu_and_mul's output, without writing and reading that output. One program holds a row."""
    num_tokens, intermediate = _checked(gate_up)
    if intermediate > MAX_FP8_ROW:
        raise ValueError(f"gate_up's half width {intermediate} exceeds the FP8 launch's row of {MAX_FP8_ROW}")
    q = torch.empty(num_tokens, intermediate, dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty(num_tokens, dtype=torch.float32, device=gate_up.device)
    if num_tokens:
        block = next_power_of_2(intermediate)
        _silu_and_mul[(num_tokens, 1)](
            gate_up,
            q,
            scale,
            gate_up.stride(0),
            INTERMEDIATE=intermediate,
            BLOCK=block,
            FP8_OUT=True,
            GELU_TANH=False,
            num_warps=min(16, max(4, block // 1024)),
            **pdl_options(gate_up.device),
        )
    return q, scale


def _checked(gate_up: torch.Tensor) -> tuple[int, int]:
    """gate_up's rows and half width (the intermediate size)."""
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got {width}")
    if gate_up.stride(1) != 1:
        raise ValueError("gate_up's last dimension must be contiguous")
    return num_tokens, width // 2


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure torch, as transformers' LlamaMLP computes act_fn(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated activation: gelu(gate, approximate="tanh") * up, one launch (silu_and_mul's)."""
    return silu_and_mul(gate_up, gelu_tanh=True)


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure torch, as transformers' Gemma3MLP computes act_fn(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
