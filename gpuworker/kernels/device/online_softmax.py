"""The device side of the attention kernels' key loop (prefill, paged decode, encoder): a tile of
keys and values folded into a running softmax, FlashAttention's online softmax, in log2 units.

Kernels call `online_softmax.step(...)` through the module, so the interpreter's launches can swap
in interpretable twins (launch.py); it imports nothing of ours, so launch.py can import it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b accumulated in float32: IEEE float32 FMAs where DOT_FP32 (float32 models, and the
    interpreter: launch.dot_options), else tensor cores at DOT_PRECISION."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def step(scores, v, acc, l_i, m_i, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(acc, l_i, m_i) after one tile: scores [M, N] (log2 units, -inf where a key is not seen),
    v [N, D] the tile's values; acc [M, D] the unnormalised output, l_i [M] the sum of weights and
    m_i [M] the running maximum, all float32. The probabilities are rounded to v's dtype for the
    P.V dot, as FlashAttention does; their sum is taken before that rounding."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_FP32, DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit
def step_guarded(scores, v, acc, l_i, m_i, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """step for tiles where a row may see no key yet (a sliding window's first tiles, whose keys
    precede some rows' windows): such a row keeps m_i -inf and zero weights, where step's
    exp2(-inf - -inf) would make it NaN."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_FP32, DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit
def step_one(score, v, acc, l_i, m_i):
    """(acc, l_i, m_i) after one key held in registers: score [M] its scores (log2 units), v [D] its
    value (any float dtype, widened to float32); the other arguments as for step."""
    m_new = tl.maximum(m_i, score)
    alpha = tl.exp2(m_i - m_new)
    weight = tl.exp2(score - m_new)
    acc = acc * alpha[:, None] + weight[:, None] * v.to(tl.float32)[None, :]
    l_i = l_i * alpha + weight
    return acc, l_i, m_new
