"""DeepSeek-V2/V3 decoders: multi-head latent attention (models.deepseek.attention) and per layer
the MLP _mlp builds: the dense SiLU-gated MLP below first_k_dense_replace, DeepSeek's mixture of
experts (models.moe, routed as ModelConfig.moe says) from there on.

Same interface as models.llama's LlamaForCausalLM (forward over one ragged batch, logits, greedy
tokens, warm-up), so the engine runs either.
"""

from __future__ import annotations

import torch
from torch import nn

from gpuworker.attention.backend import AttentionBackend, AttentionMetadata
from gpuworker.models.config import ModelConfig
from gpuworker.models.deepseek.attention import MLAttention, uses_triton
from gpuworker.models.deepseek.rotary import DeepseekRotary
from gpuworker.models.layers import GatedMLP, RMSNorm, norm_then_linear
from gpuworker.models.llama import LlamaForCausalLM
from gpuworker.models.moe import SparseMoE


def _mlp(config: ModelConfig, layer_idx: int) -> GatedMLP | SparseMoE:
    """Layer layer_idx's MLP: a mixture of experts where the config makes the layer sparse."""
    if config.moe is not None and config.moe.sparse_layers[layer_idx]:
        return SparseMoE(config.hidden_size, config.moe)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: DeepseekRotary, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, rotary)
        self.mlp = _mlp(config, layer_idx)
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
        if isinstance(self.mlp, GatedMLP):
            gate_up, residual = norm_then_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual)
            return self.mlp.down(gate_up), residual
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class DeepseekForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]; one rank."""

    # The vocabulary end is the llama decoder's: the same embedding, lm_head and sampling entry points.
    compute_logits = LlamaForCausalLM.compute_logits
    greedy_tokens = LlamaForCausalLM.greedy_tokens
    lm_head_weight = LlamaForCausalLM.lm_head_weight

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, parallel: object = None) -> None:
        super().__init__()
        if config.mla is None:
            raise ValueError(f"{config.architecture} is not a multi-head latent attention model")
        if parallel is not None and getattr(parallel, "world_size", 1) > 1:
            raise ValueError("tensor_parallel_size > 1 is not supported for multi-head latent attention yet")
        if config.quantization is not None:
            raise ValueError(f"{config.model_path}: quantized DeepSeek checkpoints are not supported yet")
        self.config = config
        self.attn_backend = attn_backend
        self.parallel = None
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.rotary = DeepseekRotary(config.mla, config.max_position_embeddings)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, self.rotary, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens[input_ids]
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

    def checkpoint_names(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Hugging Face tensor name -> (our parameter, first row, rows) it fills."""
        names: dict[str, tuple[torch.Tensor, int, int]] = {}

        def add(name: str, param: torch.Tensor | None, start: int = 0, rows: int | None = None) -> None:
            if param is not None:
                names[name] = (param, start, param.shape[0] if rows is None else rows)

        add("model.embed_tokens.weight", self.embed_tokens)
        add("model.norm.weight", self.norm.weight)
        add("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.layers):
            prefix, attn = f"model.layers.{i}.", layer.self_attn
            for module in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
                linear = getattr(attn, module)
                if linear is not None:
                    add(f"{prefix}self_attn.{module}.weight", linear.weight)
                    add(f"{prefix}self_attn.{module}.bias", linear.bias)
            for norm in ("q_a_layernorm", "kv_a_layernorm"):
                if getattr(attn, norm) is not None:
                    add(f"{prefix}self_attn.{norm}.weight", getattr(attn, norm).weight)
            mlp = layer.mlp
            if isinstance(mlp, GatedMLP):
                inter = mlp.intermediate_size
                add(f"{prefix}mlp.gate_proj.weight", mlp.gate_up_proj.weight, 0, inter)
                add(f"{prefix}mlp.up_proj.weight", mlp.gate_up_proj.weight, inter, inter)
                add(f"{prefix}mlp.down_proj.weight", mlp.down_proj.weight)
            add(f"{prefix}input_layernorm.weight", layer.input_layernorm.weight)
            add(f"{prefix}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        return names
