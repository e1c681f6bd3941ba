"""Multi-head latent attention (DeepSeek-V2 paper, section 2.1) over the paged latent cache.

Per token the layer caches one row: the compressed latent (kv_a_proj_with_mqa's first kv_lora_rank
outputs after kv_a_layernorm) and the rotated shared key. A step's prefill chunks expand their
sequences' cached latents all at once (one gather, one kv_b_proj GEMM) into per-head keys and values,
so a chunk sees the cached tokens of earlier chunks and of a prefix-cache hit, and attend causally
from the end of their context: the Triton MLA prefill kernel, one launch for all of them, or per
sequence in torch (the float32 reference on the CPU).
Decode rows absorb: the position-free query times W_UK (kv_b_proj's key rows) is a query over the
latent itself, attention runs over the cache rows directly (the Triton MLA decode kernel, or its
torch reference), and the latent result times W_UV (kv_b_proj's value rows) is each head's value.
Nothing in the decode path reads a device value on the host. An FP8 cache (kv_cache_dtype "fp8")
holds the row divided by the layer's k_scale, widened back as it is read.

Under tensor parallelism a rank holds its num_heads / N heads: its rows of q_proj (or q_b_proj) and
kv_b_proj and its columns of o_proj (row-parallel, joined by an all-reduce). The latent and the
rotary key are per token, not per head, so q_a_proj, kv_a_proj_with_mqa and the paged latent cache
are whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuworker.attention.backend import AttentionBackend, AttentionMetadata
from gpuworker.attention.torch_backend import attend
from gpuworker.kernels.attention.mla_decode import mla_decode_reference
from gpuworker.kernels.quant.kv_cache import dequantize_kv
from gpuworker.models.config import ModelConfig
from gpuworker.models.deepseek import prefill_buffer
from gpuworker.models.deepseek.rotary import DeepseekRotary
from gpuworker.models.layers import Linear, RMSNorm
from gpuworker.models.tensor_parallel import ParallelContext, RowParallelLinear

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV2RMSNorm's default eps, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def uses_triton(backend: AttentionBackend) -> bool:
    return getattr(backend, "name", "") == "triton"


def attend_expanded(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, fused: bool
) -> torch.Tensor:
    """Causal attention of a chunk's queries [Q, H, qk] (the last Q positions of the context) over
    the context's expanded keys [S, H, qk] and values [S, H, v] -> [Q, H, v]. fused: torch's
    scaled_dot_product_attention, which never holds the [H, Q, S] scores of a long prefill in
    float32 (the GPU path); else the float32 reference of the torch backend."""
    if not fused:
        return attend(query, keys, values, scale)
    num_queries, context_len = query.shape[0], keys.shape[0]
    query_pos = torch.arange(context_len - num_queries, context_len, device=query.device)
    mask = torch.arange(context_len, device=query.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: DeepseekRotary, parallel: ParallelContext | None = None) -> None:
        """config: the shapes this rank holds (num_heads its share, models.tensor_parallel.shard_config)."""
        super().__init__()
        mla = self.mla = config.mla
        self.num_heads = config.num_heads
        self.kv_lora_rank = mla.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_head_dim = mla.qk_head_dim
        self.scale = mla.softmax_scale
        bias = config.o_proj_bias  # the config's attention_bias: q_a, kv_a and o projections
        q_size = self.num_heads * self.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(config.hidden_size, q_size)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(config.hidden_size, mla.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_size)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, mla.cache_width, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        o_in = self.num_heads * self.v_dim
        self.o_proj = (
            Linear(o_in, config.hidden_size, bias)
            if parallel is None
            else RowParallelLinear(o_in, config.hidden_size, bias, parallel)
        )
        self._rotary = (rotary,)  # shared by all layers, kept out of the module tree
        # An FP8 cache's static scale for this layer's latent and rotary key: the checkpoint's
        # self_attn.k_scale, as vLLM reads it for latent attention (else 1.0; models.quantization.
        # kv_scales); a host float, so a CUDA graph holds it as a constant. There is no value cache,
        # so a v_scale is read and unused.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """hidden [T, hidden_size] (after input_layernorm); kv_cache [1, blocks, block_size, 1, R + E]."""
        num_tokens = hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        rotary = self._rotary[0]
        q_pe = rotary(positions, q_pe)
        k_pe = rotary(positions, k_pe.unsqueeze(1)).squeeze(1).contiguous()
        latent_cache = kv_cache[0, :, :, 0]  # [blocks, block_size, R + E]
        self._write(latent, k_pe, latent_cache, meta, backend, self.k_scale)

        out = hidden.new_zeros(num_tokens, self.num_heads, self.v_dim)
        num_decode = meta.num_decode_seqs
        if num_decode > 0:
            out[:num_decode] = self._decode(q_nope[:num_decode], q_pe[:num_decode], latent_cache, meta, backend)
        if meta.num_seqs > num_decode:
            self._prefill(q_nope, q_pe, latent_cache, meta, backend, out)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    @staticmethod
    def _write(
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        kv_scale: float,
    ) -> None:
        if uses_triton(backend):
            from gpuworker.kernels.attention.mla_cache_write import mla_cache_write

            mla_cache_write(latent, k_pe, latent_cache, meta.slot_mapping, kv_scale)
        else:
            from gpuworker.kernels.attention.mla_cache_write import mla_cache_write_reference

            mla_cache_write_reference(latent, k_pe, latent_cache, meta.slot_mapping, kv_scale)

    def _kv_b_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, R], W_UV [H, v, R]): kv_b_proj's rows per head, as views."""
        weight = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return weight[:, : self.nope_dim], weight[:, self.nope_dim :]

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The absorbed decode of the first num_decode_seqs rows -> [B, H, v]."""
        w_uk, w_uv = self._kv_b_heads()
        num_decode = q_nope.shape[0]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, B, R]
        query = torch.cat((q_latent.transpose(0, 1), q_pe), dim=-1)  # [B, H, R + E]
        tables, seq_lens = meta.block_tables[:num_decode], meta.seq_lens[:num_decode]
        if uses_triton(backend):
            from gpuworker.kernels.attention.mla_decode import mla_decode

            latent_out = mla_decode(
                query,
                latent_cache,
                tables,
                seq_lens,
                self.scale,
                self.kv_lora_rank,
                meta.max_seq_len,
                kv_scale=self.k_scale,
            )
        else:
            latent_out = mla_decode_reference(
                query,
                latent_cache,
                tables,
                meta.seq_lens_cpu[:num_decode],
                self.scale,
                self.kv_lora_rank,
                self.k_scale,
            )
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        out: torch.Tensor,
    ) -> None:
        """The prefill chunks after the decode rows (into `out`), in groups of consecutive sequences
        whose expanded context stays within prefill_buffer.group_rows (one group, in all but steps
        of very long contexts); engine.sizing leaves room for the largest group."""
        max_rows = prefill_buffer.group_rows(self.mla, self.num_heads)
        groups = prefill_buffer.context_groups(meta.seq_lens_cpu, meta.num_decode_seqs, meta.num_seqs, max_rows)
        for first, last in groups:
            self._prefill_group(q_nope, q_pe, latent_cache, meta, backend, out, first, last)

    def expand_group(
        self, latent_cache: torch.Tensor, meta: AttentionMetadata, first: int, last: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_nope [S, H, nope], k_rope [S, H, rope] (a broadcast view), values [S, H, v],
        cu_seqlens_k) of sequences first..last-1: their cached latents gathered at once and expanded
        by one kv_b_proj GEMM. What it allocates is prefill_buffer.row_bytes per context row."""
        context = sum(meta.seq_lens_cpu[first:last])
        slots, cu_seqlens_k = context_slots(meta, first, last, latent_cache.shape[1], context)
        rows = latent_cache.reshape(-1, latent_cache.shape[-1])[slots]
        if rows.dtype != dtype:  # an FP8 cache; a cache in the model dtype is read as it is
            rows = dequantize_kv(rows, self.k_scale).to(dtype)
        latent, k_pe = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(context, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1), values, cu_seqlens_k

    def _prefill_group(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        out: torch.Tensor,
        first: int,
        last: int,
    ) -> None:
        """Sequences first..last-1: their keys and values expanded (expand_group), then causal
        attention of each chunk over its own sequence's rows (the Triton MLA prefill kernel in one
        launch, or per sequence in torch)."""
        k_nope, k_rope, values, cu_seqlens_k = self.expand_group(latent_cache, meta, first, last, q_nope.dtype)
        if uses_triton(backend):
            from gpuworker.kernels.attention.mla_prefill import mla_prefill_attention

            cu_seqlens_q = meta.query_start_loc[first : last + 1]
            mla_prefill_attention(
                q_nope,
                q_pe,
                k_nope,
                k_rope,
                values,
                cu_seqlens_q,
                cu_seqlens_k,
                meta.max_query_len,
                self.scale,
                out=out,
            )
            return
        qsl, k_start = meta.query_start_loc_cpu, 0
        for i, seq_len in enumerate(meta.seq_lens_cpu[first:last], start=first):
            start, end, keys_end = qsl[i], qsl[i + 1], k_start + seq_len
            if end > start:
                keys = torch.cat((k_nope[k_start:keys_end], k_rope[k_start:keys_end]), dim=-1)
                query = torch.cat((q_nope[start:end], q_pe[start:end]), dim=-1)
                out[start:end] = attend_expanded(query, keys, values[k_start:keys_end], self.scale, fused=query.is_cuda)
            k_start = keys_end


def context_slots(
    meta: AttentionMetadata, first: int, last: int, block_size: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [context] int64, cu_seqlens_k [last - first + 1] int32) of sequences first..last-1's
    context positions, sequence after sequence, built on the device without reading it on the host;
    context: the host's sum of their seq_lens."""
    seq_lens = meta.seq_lens[first:last]
    device = seq_lens.device
    cu_seqlens_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    seq_index = torch.repeat_interleave(torch.arange(last - first, device=device), seq_lens, output_size=context)
    positions = torch.arange(context, device=device) - cu_seqlens_k[seq_index]
    blocks = meta.block_tables[first:last][seq_index, positions // block_size]
    return blocks.long() * block_size + positions % block_size, cu_seqlens_k
