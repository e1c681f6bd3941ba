"""The output tile of a matmul program over a grid of (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) tiles of
out [M, N] (the quantized GEMMs of quant/): which rows and columns it owns, and how it writes them.

    offs_m, offs_n, offs_k, m_mask, n_mask = matmul_tile.offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    ...  # the K loop into a float32 acc [BLOCK_M, BLOCK_N]
    acc = matmul_tile.add_bias(acc, bias_ptr, offs_n, n_mask, HAS_BIAS)
    matmul_tile.store(out_ptr, acc, stride_om, offs_m, offs_n, m_mask, n_mask)

Kernels call these through the module, so the interpreter's launches can swap in interpretable twins
(launch.py); Triton inlines them, so the kernels compile to what they did with the code written out.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(offs_m, offs_n, offs_k, m_mask, n_mask): program (i, j) of the grid's first two axes owns rows
    i * BLOCK_M + [0, BLOCK_M) and columns j * BLOCK_N + [0, BLOCK_N), those past M or N masked off;
    offs_k spans one K step."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    return offs_m, offs_n, offs_k, m_mask, n_mask


@triton.jit
def add_bias(acc, bias_ptr, offs_n, n_mask, HAS_BIAS: tl.constexpr):
    """acc ([BLOCK_M, BLOCK_N] float32) plus the bias [N] of the tile's columns when HAS_BIAS."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def store(out_ptr, acc, stride_om, offs_m, offs_n, m_mask, n_mask):
    """acc written in out_ptr's dtype to the tile's rows (stride_om apart) and columns inside [M, N].
    A separate step from add_bias so that a kernel can move out_ptr in between (block_fp8_matmul's
    split-K partial sums) and still compile to what it did with the code written out."""
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )
