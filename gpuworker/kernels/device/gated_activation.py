"""The device side of the gated MLP's activation: silu(gate) * up, as the fused activation kernel
and the GEMV that takes the gate_up output as its input compute it.

Numerics as transformers' Llama MLP in the activation dtype: silu in float32, rounded, then the
product rounded again. Kernels call it through the module, so the interpreter's launches can swap in
an interpretable twin (launch.py); it imports nothing of ours. gelu_tanh_and_mul is Gemma's gate:
GELU with the tanh approximation, in float32 and rounded, as torch's gelu(approximate="tanh").
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_and_mul(gate, up):
    """silu(gate) * up in gate's dtype (the activation dtype)."""
    g32 = gate.to(tl.float32)
    activated = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    return (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def gelu_tanh_and_mul(gate, up):
    """gelu_tanh(gate) * up in gate's dtype: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) in
    float32 (tanh as 1 - 2 / (exp(2y) + 1), exact at both ends), rounded, times up, rounded."""
    g32 = gate.to(tl.float32)
    inner = 0.7978845608028654 * (g32 + 0.044715 * g32 * g32 * g32)
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    activated = (0.5 * g32 * (1.0 + tanh)).to(gate.dtype)
    return (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
