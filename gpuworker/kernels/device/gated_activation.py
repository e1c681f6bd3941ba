"""The device side of the gated MLP's activation: silu(gate) * up, as the fused activation kernel
and the GEMV that takes the gate_up output as its input compute it.

Numerics as transformers' Llama MLP in the activation dtype: silu in float32, rounded, then the
product rounded again. Kernels call it through the module, so the interpreter's launches can swap in
an interpretable twin (launch.py); it imports nothing of ours.
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
