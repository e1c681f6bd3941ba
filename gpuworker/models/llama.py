"""The llama-style decoder: one class for Llama 1/2/3/3.1, Mistral, Qwen2/2.5 and Qwen3, and with a
sparse mixture-of-experts MLP (models.moe) for Mixtral, Qwen2-MoE, Qwen3-MoE and GLM-4.5 (partial
rotary, DeepSeek-style routing).

The families differ only in what ModelConfig resolves (biases, q/k norms, rope, head_dim, tied
embeddings, the MoE layout). Sequences arrive flattened into one ragged batch of tokens; everything ragged lives in
AttentionMetadata and is handled by the attention backend, so forward has no host syncs and no
data-dependent Python control flow (decode steps can be captured in CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuworker.attention.backend import AttentionBackend, AttentionMetadata, fuses_rotary_and_cache_write
from gpuworker.kernels.norm.qk_norm import QKNorm
from gpuworker.models.config import ModelConfig
from gpuworker.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, norm_then_linear
from gpuworker.models.moe import SparseMoE
from gpuworker.models.tensor_parallel import (
    ParallelContext,
    ParallelGatedMLP,
    RowParallelLinear,
    active,
    shard_config,
    vocab_parallel_embedding,
    vocab_parallel_logits,
    vocab_range,
)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        # q, k and v fused into one GEMM (rows: q, then k, then v), as gpt-fast and vLLM do.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias)
        self.o_proj = (
            Linear(self.q_size, config.hidden_size, config.o_proj_bias)
            if parallel is None
            else RowParallelLinear(self.q_size, config.hidden_size, config.o_proj_bias, parallel)
        )
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # Shared by all layers; kept out of the module tree so it is not registered once per layer.
        self._rotary = (rotary,)
        # An FP8 KV cache's static scales for this layer (the checkpoint's, else 1.0: see
        # models.quantization.kv_scales); host floats, so a CUDA graph holds them as constants.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def fused_qk_norm(self, dtype: torch.dtype) -> QKNorm | None:
        """The q/k norms (Qwen3) as the rotary launches take them, for activations of `dtype`; None
        without them or where the launches cannot reproduce the two RMSNorm modules (weights of
        another dtype, whose product torch would promote; two different eps)."""
        if self.q_norm is None or self.k_norm is None or self.q_norm.eps != self.k_norm.eps:
            return None
        if self._rotary[0].head_dim != self.head_dim:  # partial rotary: the launches norm whole heads only
            return None
        if self.q_norm.weight.dtype != dtype or self.k_norm.weight.dtype != dtype:
            return None
        return QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def attend(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Everything after qkv_proj (which the decoder layer runs fused with its norm): rotary,
        cache write, attention and o_proj."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        fused = fuses_rotary_and_cache_write(backend)
        qk_norm = self.fused_qk_norm(q.dtype) if fused else None
        if self.q_norm is not None and qk_norm is None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if fused:
            # The backend rotates and writes the cache itself (decode rows: inside the attention launch),
            # normalising the heads first when it takes the q/k norms.
            rotary = self._rotary[0]
            out = backend.forward_with_rotary(
                positions,
                q,
                k,
                v,
                kv_cache,
                meta,
                self.scale,
                rotary.cos_cache,
                rotary.sin_cache,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                qk_norm=qk_norm,
            )
        else:
            q, k = self._rotary[0](positions, q, k)
            out = backend.forward(q, k, v, kv_cache, meta, self.scale, k_scale=self.k_scale, v_scale=self.v_scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, index: int, parallel: ParallelContext | None = None
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary, parallel)
        self.mlp = decoder_mlp(config, index, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it).

        The residual add is deferred into the next norm, which fuses it: the stream after the
        layer is hidden + residual, formed by whoever normalises it next.
        """
        attn = self.self_attn
        qkv, residual = norm_then_linear(self.input_layernorm, attn.qkv_proj, hidden, residual)
        hidden = attn.attend(positions, qkv, kv_cache, meta, backend)
        return mlp_after_attention(self.post_attention_layernorm, self.mlp, hidden, residual)


def decoder_mlp(config: ModelConfig, index: int, parallel: ParallelContext | None) -> GatedMLP | SparseMoE:
    """Layer `index`'s MLP: the mixture of experts where the config makes the layer sparse, else the
    dense gated MLP (this rank's share of it when split)."""
    if config.moe is not None and config.moe.sparse_layers[index]:
        return SparseMoE(config.hidden_size, config.moe, parallel)
    if parallel is None:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
    return ParallelGatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, parallel)


def mlp_after_attention(
    norm: RMSNorm, mlp: GatedMLP | SparseMoE, hidden: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's second half: the post-attention norm (adding the residual) and the MLP; a dense MLP
    takes the norm fused into its gate_up projection (norm_then_linear). -> (MLP output, residual)."""
    if isinstance(mlp, SparseMoE):
        normed, residual = norm(hidden, residual)
        return mlp(normed), residual
    gate_up, residual = norm_then_linear(norm, mlp.gate_up_proj, hidden, residual)
    return mlp.down(gate_up), residual


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size].

    With a `parallel` context of several ranks, this rank's shard (models.tensor_parallel); `config`
    stays the whole model's."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, parallel: ParallelContext | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.parallel = active(parallel)
        layer_config = shard_config(config, self.parallel)
        vocab_rows = config.vocab_size if self.parallel is None else vocab_range(config.vocab_size, self.parallel)[2]
        self.embed_tokens = nn.Parameter(torch.empty(vocab_rows, config.hidden_size), requires_grad=False)
        # Rotates the first rotary_width dims of each head (all but where partial_rotary_factor says).
        self.rotary = RotaryEmbedding(
            config.rotary_width, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(layer_config, self.rotary, i, self.parallel) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(torch.empty(vocab_rows, config.hidden_size), requires_grad=False)

    @torch.inference_mode()
    def warm_up(self, kv_cache: torch.Tensor, max_model_len: int, dtype: torch.dtype) -> None:
        """Compile the kernels this model picks by shape at run time, which the engine's short
        warm-up step does not reach: on the GPU its experts' variants (the MoE layers share their
        kernels, so the first one's warm-up compiles them all), and its attention backend's decode
        variants for contexts up to max_model_len, launched as the layers launch them (activations
        of `dtype`, the rotary cache, the fused q/k norms) on `kv_cache`, one layer's, which they
        leave unwritten."""
        if kv_cache.is_cuda:
            moe = next((m for m in self.modules() if isinstance(m, SparseMoE)), None)
            if moe is not None:
                moe.warm_up()
        backend = self.attn_backend
        if hasattr(backend, "warm_up"):
            attn = self.layers[0].self_attn
            backend.warm_up(
                kv_cache,
                attn.num_heads,
                max_model_len,
                attn.scale,
                self.rotary.cos_cache,
                self.rotary.sin_cache,
                dtype,
                attn.fused_qk_norm(dtype),
            )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.parallel is None:
            hidden = self.embed_tokens[input_ids]
        else:
            hidden = vocab_parallel_embedding(self.embed_tokens, input_ids, self.config.vocab_size, self.parallel)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.attn_backend)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (rows already selected) -> logits [N, vocab_size] in float32."""
        weight = self.lm_head_weight
        if self.parallel is not None:
            return vocab_parallel_logits(hidden, weight, self.config.vocab_size, self.parallel)
        if hidden.is_cuda:
            from gpuworker.kernels.linear.gemv import gemv, tuned_config

            config = tuned_config(hidden, weight)
            if config is not None:
                return gemv(hidden, weight, config=config).float()
        return F.linear(hidden, weight).float()

    def greedy_tokens(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden_size] (rows already selected) -> each row's argmax token [N] int64
        (written into `out` if given).

        The same tokens as compute_logits(hidden).argmax(-1). On the GPU the lm_head GEMV takes the
        argmax in its own launch and no float32 logits are made.
        """
        weight = self.lm_head_weight
        if hidden.is_cuda and self.parallel is None:
            from gpuworker.kernels.linear.gemv import gemv_argmax, tuned_config

            config = tuned_config(hidden, weight)
            if config is not None and config.split_k == 1:
                return gemv_argmax(hidden, weight, config=config, argmax_out=out)[1]
        return torch.argmax(self.compute_logits(hidden), dim=-1, out=out)
