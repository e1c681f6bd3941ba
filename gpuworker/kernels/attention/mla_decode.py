"""Paged decode attention of multi-head latent attention (DeepSeek-V2/V3) with absorbed weights.

Each decode query arrives already absorbed: per head, the position-free part of its query times
W_UK (the key half of kv_b_proj) gives kv_lora_rank values, followed by its rotated part. The cache
holds per token one row of kv_lora_rank + rope_dim values, the normalised latent then the rotated
shared key, and serves as both the key (the whole row) and the value (the latent): every head reads
the same row, so one tile of the cache is loaded once for BLOCK_H heads. The output is the latent
per head; the caller multiplies it by W_UV.

Flash-decoding: the context is split into num_splits partitions (a host choice from max_seq_len,
so a CUDA graph captured at max_model_len replays for any context), each program attends to its
partition with an online softmax, and a second kernel merges the partitions by their
log-sum-exps. Nothing is read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpuworker.kernels import configs
from gpuworker.kernels.launch import dot_options, lazy_jit
from gpuworker.kernels.quant.kv_cache import check_kv_scale, dequantize_kv, is_fp8_cache

KERNEL = "mla_decode"
TABLE_KEY = ("dtype", "kv_lora_rank", "rope_dim")
MAX_SPLITS = 16


@dataclass(frozen=True)
class MLADecodeConfig:
    block_h: int = 16  # query heads sharing each cache tile (tl.dot needs 16 rows)
    block_n: int = 32  # cached tokens per tile
    split_tokens: int = 512  # context per partition before another split is added
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_CONFIG = MLADecodeConfig()


def tuned_config(dtype: torch.dtype, kv_lora_rank: int, rope_dim: int, device: torch.device) -> MLADecodeConfig:
    """The device's measured tile for this shape (configs/mla_decode/<GPU>.json), else the default."""
    name = str(dtype).removeprefix("torch.")
    table = configs.table(KERNEL, TABLE_KEY, device, build=MLADecodeConfig)
    return table.get((name, kv_lora_rank, rope_dim), DEFAULT_CONFIG)


def num_splits_for(max_seq_len: int, config: MLADecodeConfig) -> int:
    return max(1, min(MAX_SPLITS, -(-max_seq_len // config.split_tokens)))


def _mla_decode_partition_kernel(
    q_ptr,  # [B, H, R + E]
    cache_ptr,  # [slots, R + E]
    block_tables_ptr,  # [B, width] int32
    seq_lens_ptr,  # [B] int32
    part_out_ptr,  # [B, H, NUM_SPLITS, BLOCK_R] float32
    part_lse_ptr,  # [B, H, NUM_SPLITS] float32
    scale,
    kv_scale,
    num_heads,
    stride_qb,
    stride_qh,
    stride_cache,
    stride_bt,
    KV_RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    r = tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_E)
    head_mask = heads < num_heads
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + r[None, :], mask=head_mask[:, None] & (r[None, :] < KV_RANK), other=0.0)
    q_pe = tl.load(q_rows + KV_RANK + e[None, :], mask=head_mask[:, None] & (e[None, :] < ROPE), other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n in range(start, end, BLOCK_N):
        tokens = n + tl.arange(0, BLOCK_N)
        valid = tokens < end
        blocks = tl.load(block_tables_ptr + b * stride_bt + tokens // PAGE, mask=valid, other=0)
        rows = cache_ptr + (blocks.to(tl.int64) * PAGE + tokens % PAGE)[:, None] * stride_cache
        latent = tl.load(rows + r[None, :], mask=valid[:, None] & (r[None, :] < KV_RANK), other=0.0)
        k_pe = tl.load(rows + KV_RANK + e[None, :], mask=valid[:, None] & (e[None, :] < ROPE), other=0.0)
        if FP8_CACHE:  # widened exactly, scaled in float32, then the query's dtype for the dots
            latent = (latent.to(tl.float32) * kv_scale).to(q_lat.dtype)
            k_pe = (k_pe.to(tl.float32) * kv_scale).to(q_lat.dtype)
        if DOT_FP32:
            latent = latent.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m = m_new

    # An empty partition (a short context) leaves lse -inf and zeros: the merge gives it no weight.
    has = l_sum > 0
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    part = (b * num_heads + heads) * NUM_SPLITS + split
    tl.store(part_lse_ptr + part, lse, mask=head_mask)
    tl.store(part_out_ptr + part[:, None] * BLOCK_R + r[None, :], out, mask=head_mask[:, None])


def _mla_decode_merge_kernel(
    part_out_ptr,  # [B, H, NUM_SPLITS, BLOCK_R] float32
    part_lse_ptr,  # [B, H, NUM_SPLITS] float32
    out_ptr,  # [B, H, R]
    stride_ob,
    stride_oh,
    num_heads,
    KV_RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    r = tl.arange(0, BLOCK_R)
    base = (b * num_heads + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no context at all: zero weights, zero output
    weights = tl.exp(lse - top)
    total = tl.sum(weights, axis=0)
    parts = tl.load(
        part_out_ptr + (base + s)[:, None] * BLOCK_R + r[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0
    )
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + r, out.to(out_ptr.dtype.element_ty), mask=r < KV_RANK)


# Per step: the batch's slices of the metadata and the block tables' width change.
_mla_decode_partition = lazy_jit(
    _mla_decode_partition_kernel, do_not_specialize=("block_tables_ptr", "seq_lens_ptr", "stride_bt")
)
_mla_decode_merge = lazy_jit(_mla_decode_merge_kernel)


def mla_decode(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    config: MLADecodeConfig | None = None,
    num_splits: int | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """query [B, H, R + E] (absorbed latent part, then rotated part); latent_cache [num_blocks,
    block_size, R + E]; block_tables [B, width] int32; seq_lens [B] int32 (this step's token included, already cached)
    -> [B, H, R] in query's dtype. max_seq_len: a host bound on seq_lens, which sets num_splits.
    An FP8 cache (float8_e4m3fn) holds each value divided by kv_scale (kernels.quant.kv_cache)."""
    if latent_cache.dim() != 3:
        raise ValueError(f"latent_cache must be [num_blocks, block_size, width], got {tuple(latent_cache.shape)}")
    cache = latent_cache
    num_blocks, page, width = cache.shape
    batch, num_heads, q_width = query.shape
    rope = width - kv_lora_rank
    if q_width != width or rope < 1:
        raise ValueError(f"query width {q_width} must equal the cache's {width} (kv_lora_rank {kv_lora_rank} + rope)")
    if query.stride(-1) != 1 or cache.stride(2) != 1 or cache.stride(1) != width or cache.stride(0) != page * width:
        raise ValueError("query needs contiguous rows and latent_cache contiguous blocks of rows")
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} need {batch} rows"
        )
    if out is None:
        out = torch.empty(batch, num_heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    config = config or tuned_config(query.dtype, kv_lora_rank, rope, query.device)
    splits = num_splits or num_splits_for(max_seq_len, config)
    block_r = max(16, triton.next_power_of_2(kv_lora_rank))
    block_e = max(16, triton.next_power_of_2(rope))
    part_out = torch.empty(batch, num_heads, splits, block_r, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
    _mla_decode_partition[(batch, triton.cdiv(num_heads, config.block_h), splits)](
        query,
        cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        scale,
        check_kv_scale("kv_scale", kv_scale),
        num_heads,
        query.stride(0),
        query.stride(1),
        cache.stride(1),
        block_tables.stride(0),
        KV_RANK=kv_lora_rank,
        ROPE=rope,
        BLOCK_R=block_r,
        BLOCK_E=block_e,
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        PAGE=page,
        NUM_SPLITS=splits,
        **dot_options(query.dtype),
        FP8_CACHE=is_fp8_cache(cache),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    _mla_decode_merge[(batch, num_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        KV_RANK=kv_lora_rank,
        BLOCK_R=block_r,
        NUM_SPLITS=splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
    )
    return out


def mla_decode_reference(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    kv_lora_rank: int,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """The same attention in float32 torch, one sequence at a time (seq_lens on the host)."""
    page = latent_cache.shape[1]
    cache = latent_cache.reshape(-1, latent_cache.shape[-1])
    out = torch.zeros(*query.shape[:2], kv_lora_rank, dtype=query.dtype, device=query.device)
    offsets = torch.arange(page, device=query.device)
    for b, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            continue
        blocks = block_tables[b, : -(-seq_len // page)].long()
        rows = dequantize_kv(cache[(blocks[:, None] * page + offsets[None, :]).reshape(-1)[:seq_len]], kv_scale)
        scores = torch.einsum("hw,sw->hs", query[b].float(), rows) * scale
        out[b] = (torch.softmax(scores, dim=-1) @ rows[:, :kv_lora_rank]).to(query.dtype)
    return out
