"""The device side of kv_cache_quant.py: how a kernel quantizes a key or value for an FP8 cache (and
fp8_matmul's activations).

Kernels call `fp8_codec.quantize(...)` through the module (so the interpreter's launches can swap
in an interpretable twin, see launch.py). The rounding is done in float32 arithmetic: Triton's CPU
interpreter rounds float32 -> e4m3 wrongly near a power of two (it halves the value instead of
carrying into the exponent), and with the value already on the e4m3 grid every backend's cast is
exact, so the kernels store what torch's cast stores, on the GPU and in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpuworker.kernels.quant.kv_cache import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def quantize(x, scale):
    """x / scale (IEEE division, as torch's) clamped to +-FP8_MAX and rounded to the nearest e4m3
    value, ties to even, as float32: the cast to float8e4nv that follows changes nothing."""
    return round_to_e4m3(tl.math.div_rn(x.to(tl.float32), scale))


@triton.jit
def quantize_row(x):
    """A float32 row held in registers (lanes past its end zero) -> (its FP8 values as float32, its
    scale): per-token dynamic quantization, as fp8_matmul.quantize_fp8_rows_reference computes it."""
    scale = row_scale(x)
    return quantize_by_reciprocal(x, scale), scale


@triton.jit
def row_scale(x):
    """The per-token scale of a row (or of its running magnitudes): its largest magnitude mapped to
    FP8_MAX, a correctly rounded division."""
    return tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), _FP8_MAX)


@triton.jit
def quantize_by_reciprocal(x, scale):
    """float32 x times scale's correctly rounded reciprocal (one division, not one a value), clamped
    and rounded to the nearest e4m3 value as float32."""
    return round_to_e4m3(x * tl.math.div_rn(1.0, scale))


@triton.jit
def round_to_e4m3(x):
    """float32 x clamped to +-FP8_MAX and rounded to the nearest e4m3 value, ties to even, as float32."""
    x = tl.clamp(x, -_FP8_MAX, _FP8_MAX)
    # e4m3 keeps 3 mantissa bits: values in [2^e, 2^(e+1)) are multiples of 2^(e-3); below the
    # smallest normal (2^-6) the subnormals are multiples of 2^-9.
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # Adding 1.5 * 2^23 quanta leaves a float32 whose last place is one quantum, so the addition
    # rounds x to a multiple of it (ties to even); subtracting gives it back exactly.
    magic = quantum * 12582912.0
    return (x + magic) - magic
