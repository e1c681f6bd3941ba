"""Gemma 3's text decoder (transformers' Gemma3ForCausalLM) on the llama path's ragged, paged batch.

What differs from models.llama: embeddings scaled by sqrt(hidden_size) (rounded to the model dtype,
as transformers does), Gemma's RMSNorm (x * (1 + weight) in float32), four norms per layer (the
attention and MLP outputs are normalised before their residual add), a GELU-tanh gated MLP, q/k
norms of Gemma's kind, attention scale query_pre_attn_scalar ** -0.5, and two kinds of layers:
sliding-window layers (their own rope base, keys of the last `sliding_window` positions only) and
full-attention layers (rope_theta with its scaling). Logits are softcapped where the config says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuworker.attention.backend import AttentionBackend, AttentionMetadata, fuses_rotary_and_cache_write
from gpuworker.models.config import ModelConfig
from gpuworker.models.gemma3.layers import GeluGatedMLP, GemmaRMSNorm
from gpuworker.models.layers import Linear, RotaryEmbedding
from gpuworker.models.llama import LlamaForCausalLM
from gpuworker.models.tensor_parallel import ParallelContext, active


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        layout = config.gemma3
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = layout.query_pre_attn_scalar**-0.5
        self.window = window  # None: full attention
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self._rotary = (rotary,)  # shared by the layers of its kind, kept out of the module tree
        self.k_scale = 1.0  # an FP8 KV cache's static scales (models.quantization.kv_scales)
        self.v_scale = 1.0

    def fused_qk_norm(self, dtype: torch.dtype) -> None:
        """None: the rotary launches' q/k norm is Llama's; Gemma's runs before them."""
        return None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        rotary = self._rotary[0]
        windowed = getattr(meta, "windowed", None)
        if self.window is not None and windowed is not None:
            meta = windowed  # the sliding layers' own pool of blocks
        kwargs = dict(k_scale=self.k_scale, v_scale=self.v_scale, sliding_window=self.window)
        if fuses_rotary_and_cache_write(backend):
            out = backend.forward_with_rotary(
                positions, q, k, v, kv_cache, meta, self.scale, rotary.cos_cache, rotary.sin_cache, **kwargs
            )
        else:
            q, k = rotary(positions, q, k)
            out = backend.forward(q, k, v, kv_cache, meta, self.scale, **kwargs)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, rotary, window)
        self.mlp = GeluGatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta, backend)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size], as
    LlamaForCausalLM's; one rank only (no tensor parallelism)."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, parallel: ParallelContext | None = None
    ) -> None:
        nn.Module.__init__(self)
        if active(parallel) is not None:
            raise ValueError(f"{config.architecture} does not run tensor-parallel; use one GPU")
        layout = config.gemma3
        self.config = config
        self.attn_backend = attn_backend
        self.parallel = None
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        max_pos = config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.head_dim, max_pos, layout.rope_theta, layout.rope_scaling)
        self.local_rotary = RotaryEmbedding(config.head_dim, max_pos, layout.local_rope_theta, None)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, self.local_rotary if window else self.rotary, window)
            for window in config.layer_windows
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        )

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) rounded to `dtype`, as transformers' scaled embedding multiplies by it."""
        return float(torch.tensor(self.config.hidden_size**0.5, dtype=dtype))

    @torch.inference_mode()
    def warm_up(self, kv_cache: torch.Tensor, max_model_len: int, dtype: torch.dtype) -> None:
        """The attention backend's decode variants, for the full layers and for the sliding ones."""
        backend = self.attn_backend
        if not hasattr(backend, "warm_up"):
            return
        done = set()
        for layer in self.layers:
            attn = layer.self_attn
            if attn.window in done:
                continue
            done.add(attn.window)
            rotary = attn._rotary[0]
            backend.warm_up(
                kv_cache,
                attn.num_heads,
                max_model_len,
                attn.scale,
                rotary.cos_cache,
                rotary.sin_cache,
                dtype,
                sliding_window=attn.window,
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens[input_ids]
        hidden = hidden * self.embed_scale(hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta, self.attn_backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As LlamaForCausalLM's, softcapped where the config says: cap * tanh(logits / cap) in the
        model dtype, as transformers computes it, then float32."""
        cap = self.config.gemma3.final_logit_softcapping
        if cap is None:
            return super().compute_logits(hidden)
        weight = self.lm_head_weight
        logits = None
        if hidden.is_cuda:
            from gpuworker.kernels.linear.gemv import gemv, tuned_config

            config = tuned_config(hidden, weight)
            if config is not None:
                logits = gemv(hidden, weight, config=config)
        if logits is None:
            logits = F.linear(hidden, weight)
        return (torch.tanh(logits / cap) * cap).float()

    def greedy_tokens(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.config.gemma3.final_logit_softcapping is None:
            return super().greedy_tokens(hidden, out)
        # tanh is monotonic, but it can round distinct large logits to one value: argmax the capped ones.
        return torch.argmax(self.compute_logits(hidden), dim=-1, out=out)
