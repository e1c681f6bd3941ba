"""DeepSeek-V2/V3 decoders: multi-head latent attention (models.deepseek.attention) and per layer
the MLP models.llama.decoder_mlp builds: the dense SiLU-gated MLP below first_k_dense_replace,
DeepSeek's mixture of experts (models.moe, routed as ModelConfig.moe says) from there on.

Same interface as models.llama's LlamaForCausalLM (forward over one ragged batch, logits, greedy
tokens, warm-up), so the engine runs either. Split over tensor-parallel ranks as the llama decoder is
(models.tensor_parallel): attention by heads (models.deepseek.attention), dense MLPs by their
intermediate size, experts by expert (all-reduce or all-to-all dispatch), the vocabulary by rows.
A block-wise FP8 checkpoint (DeepSeek-V3/R1's format) loads its projections and experts in FP8
(models.quantization.install).
"""

from __future__ import annotations

import torch
from torch import nn

from gpuworker.attention.backend import AttentionBackend, AttentionMetadata
from gpuworker.models.config import ModelConfig
from gpuworker.models.deepseek.attention import MLAttention, uses_triton
from gpuworker.models.deepseek.rotary import DeepseekRotary
from gpuworker.models.layers import RMSNorm
from gpuworker.models.llama import LlamaForCausalLM, decoder_mlp, mlp_after_attention
from gpuworker.models.moe import SparseMoE
from gpuworker.models.tensor_parallel import (
    ParallelContext,
    active,
    shard_config,
    vocab_parallel_embedding,
    vocab_range,
)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: DeepseekRotary, layer_idx: int, parallel: ParallelContext | None = None
    ) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, rotary, parallel)
        self.mlp = decoder_mlp(config, layer_idx, parallel)
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
        """(hidden, residual) -> (the MLP output, the residual stream before it), the residual add
        deferred into the next norm as in models.llama."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, normed, kv_cache, meta, backend)
        return mlp_after_attention(self.post_attention_layernorm, self.mlp, hidden, residual)


class DeepseekForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size].

    With a `parallel` context of several ranks, this rank's shard; `config` stays the whole model's."""

    # The vocabulary end is the llama decoder's: the same embedding, lm_head and sampling entry points.
    compute_logits = LlamaForCausalLM.compute_logits
    greedy_tokens = LlamaForCausalLM.greedy_tokens
    lm_head_weight = LlamaForCausalLM.lm_head_weight

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, parallel: ParallelContext | None = None
    ) -> None:
        super().__init__()
        if config.mla is None:
            raise ValueError(f"{config.architecture} is not a multi-head latent attention model")
        quant = config.quantization
        if quant is not None and quant.weight_strategy != "block":
            raise ValueError(
                f"quantization: {config.model_path}: DeepSeek models load block-wise FP8 checkpoints "
                f"(weight_block_size) only, not {quant.checkpoint_format}"
            )
        self.config = config
        self.attn_backend = attn_backend
        self.parallel = active(parallel)
        layer_config = shard_config(config, self.parallel)
        vocab_rows = config.vocab_size if self.parallel is None else vocab_range(config.vocab_size, self.parallel)[2]
        self.embed_tokens = nn.Parameter(torch.empty(vocab_rows, config.hidden_size), requires_grad=False)
        self.rotary = DeepseekRotary(config.mla, config.max_position_embeddings)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(layer_config, self.rotary, i, self.parallel) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(torch.empty(vocab_rows, config.hidden_size), requires_grad=False)

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

    @torch.inference_mode()
    def warm_up(self, kv_cache: torch.Tensor, max_model_len: int, dtype: torch.dtype) -> None:
        """Compile the experts' kernel variants (the MoE layers share them) and each split count of
        the MLA decode kernel a step can pick (a power of two up to the one max_model_len takes), on
        `kv_cache` (one layer's), reading no context."""
        if not kv_cache.is_cuda:
            return
        moe = next((m for m in self.modules() if isinstance(m, SparseMoE)), None)
        if moe is not None:
            moe.warm_up()
        if not uses_triton(self.attn_backend):
            return
        from gpuworker.kernels.attention.mla_decode import mla_decode, num_splits_for, tuned_config

        attn = self.layers[0].self_attn
        latent_cache = kv_cache[0, :, :, 0]
        query = torch.zeros(1, attn.num_heads, latent_cache.shape[-1], dtype=dtype, device=kv_cache.device)
        tables = torch.zeros(1, -(-max_model_len // latent_cache.shape[1]), dtype=torch.int32, device=kv_cache.device)
        seq_lens = torch.zeros(1, dtype=torch.int32, device=kv_cache.device)
        config = tuned_config(dtype, attn.kv_lora_rank, attn.rope_dim, kv_cache.device)
        most, splits = num_splits_for(max_model_len, config), 1
        while True:
            mla_decode(
                query,
                latent_cache,
                tables,
                seq_lens,
                attn.scale,
                attn.kv_lora_rank,
                max_model_len,
                num_splits=min(splits, most),
            )
            if splits >= most:
                break
            splits *= 2
