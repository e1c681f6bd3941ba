"""INT4 weight-only GEMM: out [M, N] = x [M, K] @ dequant(W)^T (+ bias), W [K, N] 4-bit with a
scale and a zero point per group of GROUP_SIZE input rows, dequantised in the kernel.

One layout for AWQ and GPTQ checkpoints (models.quantization converts both at load):
- qweight int32 [K / 8, N]: nibble j (bits 4j..4j+3) of qweight[i, n] is q[8i + j, n];
- zeros uint8 [K / G, N]: the zero point of each group and column (0..16: old GPTQ checkpoints
  can mean 16);
- scales float16 [K / G, N].
W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n], computed in float32 and rounded to x's
dtype before the product, as the reference does. A weight is a quarter of bf16's bytes; each program
owns a BLOCK_M x BLOCK_N tile of the output and walks K with tl.dot. A single row (batch-1 decode)
takes a GEMV of its own: each program owns GEMV_BLOCK_N adjacent columns (one contiguous run of each
packed row) and walks K a group at a time, unpacking the eight nibbles of each int32 in registers
(every weight byte read once) and applying the group's zero point and scale once per column.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gpuworker.checkpoint_quantization import int4_group_size_supported
from gpuworker.kernels.launch import (FLOAT_DTYPES, check_last_dim_contiguous, check_operand, check_tensor,
                                      dot_options, lazy_jit, pdl_options)

PACK = 8  # 4-bit values per int32


def _int4_matmul_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        kn_mask = k_mask[:, None] & n_mask[None, :]
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        packed = tl.load(qweight_ptr + (ks[:, None] // 8).to(tl.int64) * N + offs_n[None, :], mask=kn_mask, other=0)
        q = (packed >> ((ks[:, None] % 8) * 4)) & 0xF
        group = (ks // GROUP_SIZE).to(tl.int64)
        zeros = tl.load(zeros_ptr + group[:, None] * N + offs_n[None, :], mask=kn_mask, other=0).to(tl.int32)
        scales = tl.load(scales_ptr + group[:, None] * N + offs_n[None, :], mask=kn_mask, other=0.0)
        w = ((q - zeros).to(tl.float32) * scales.to(tl.float32)).to(x.dtype)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


_int4_matmul = lazy_jit(_int4_matmul_kernel, do_not_specialize=("M",))

# The batch-1 GEMV's columns per program (128 contiguous bytes of each packed row). Untuned.
GEMV_BLOCK_N = 32


def _int4_gemv_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr, N, KP,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One group per step: its GROUP_SIZE / 8 packed rows share one zero point and one scale per
    # column, so sum_k (q_k - z) * s * x_k = s * (sum_k q_k x_k - z * sum_k x_k): two FMAs per column
    # and group instead of a subtraction and a product per weight.
    ROWS: tl.constexpr = GROUP_SIZE // 8
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, ROWS)
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for group in tl.range(0, KP // ROWS, num_stages=NUM_STAGES):
        ps = group * ROWS + offs_r  # packed rows: input rows 8p .. 8p+7
        packed = tl.load(qweight_ptr + ps[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_mask[None, :],
                         other=0, eviction_policy="evict_first")
        zeros = tl.load(zeros_ptr + group * N + offs_n, mask=n_mask, other=0).to(tl.float32)
        scales = tl.load(scales_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        qx = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((ROWS,), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_ptr + ps * 8 + j, eviction_policy="evict_last").to(tl.float32)
            qx += ((packed >> (4 * j)) & 0xF).to(tl.float32) * x[:, None]
            xs += x
        acc += scales[None, :] * (qx - zeros[None, :] * xs[:, None])
    out = tl.sum(acc, axis=0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


_int4_gemv = lazy_jit(_int4_gemv_kernel)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float @ dequant(qweight, zeros, scales)^T (+ bias [N]) -> [M, N] in x's dtype
    (the layout in the module docstring), accumulated in float32."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k, n = _check_layout(x, qweight, zeros, scales, group_size)
    if bias is not None:
        check_operand("bias", bias, (n,), x.dtype, x.device)
    check_last_dim_contiguous("x", x)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if m == 1:
        _int4_gemv[(-(-n // GEMV_BLOCK_N),)](
            x, qweight, zeros, scales, bias if bias is not None else scales, out, n, k // PACK,
            GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_N=GEMV_BLOCK_N, NUM_STAGES=4, num_warps=4,
            **pdl_options(x.device))
        return out
    # Batches take tensor-core tiles. Untuned.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if x.is_cuda else 32
    block_k = min(group_size, 128 if x.is_cuda else 32)
    _int4_matmul[(-(-m // block_m), -(-n // block_n))](
        x, qweight, zeros, scales, bias if bias is not None else scales, out, m, n, k, x.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, **dot_options(x.dtype), **pdl_options(x.device))
    return out


def _check_layout(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int) -> tuple[int, int, int]:
    m, k = x.shape
    if not int4_group_size_supported(group_size) or k % group_size:
        raise ValueError(f"group_size must be a power of two of at least {PACK} dividing K ({k}), got {group_size!r}")
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=x.device)
    if qweight.shape[0] * PACK != k:
        raise ValueError(f"qweight must have K / {PACK} = {k // PACK} rows, got shape {tuple(qweight.shape)}")
    n = qweight.shape[1]
    check_operand("zeros", zeros, (k // group_size, n), torch.uint8, x.device)
    check_operand("scales", scales, (k // group_size, n), torch.float16, x.device)
    for name, tensor in (("qweight", qweight), ("zeros", zeros), ("scales", scales)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return m, k, n


def dequantize_int4(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The float32 weight [N, K] (the layout Linear holds) that the packed weight stands for."""
    q = unpack_rows(qweight)
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    w = (q - zeros.to(torch.int32)[groups]).float() * scales.float()[groups]
    return w.t()


def int4_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch: the weight dequantised in float32 and rounded to x's dtype, then F.linear."""
    weight = dequantize_int4(qweight, zeros, scales, group_size).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int values 0..15 [K, N] -> int32 [K / 8, N], row 8i + j in nibble j of row i."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"the packed dimension must be a multiple of {PACK}, got {k}")
    nibbles = q.to(torch.int64).reshape(k // PACK, PACK, n) & 0xF
    shifts = (4 * torch.arange(PACK, device=q.device, dtype=torch.int64)).reshape(1, PACK, 1)
    words = (nibbles << shifts).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """pack_rows' inverse: int32 [K / 8, N] -> int32 values 0..15 [K, N]."""
    shifts = (4 * torch.arange(PACK, device=qweight.device, dtype=torch.int32)).reshape(1, PACK, 1)
    q = (qweight.unsqueeze(1) >> shifts) & 0xF
    return q.reshape(-1, qweight.shape[1])
