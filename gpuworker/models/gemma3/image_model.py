"""Gemma3ForConditionalGeneration: Gemma 3's text decoder (models.gemma3.model) whose image tokens
take the SigLIP tower's projected output, and whose image tokens attend bidirectionally within
their image, as transformers' Gemma 3 masks them: causal OR same image (and within the window on
the sliding layers).

The backend attends causally; the rows of each image whose last token is in the step are then
attended again in torch over the keys up to that last token (read back from the paged cache,
which holds them once the backend has written the step). The scheduler never ends a prefill chunk
inside such an image (MultimodalPrompt.whole_images), so the keys are always there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpuworker.attention.backend import AttentionBackend, AttentionMetadata, fuses_rotary_and_cache_write
from gpuworker.kernels.quant.kv_cache import dequantize_kv
from gpuworker.models.config import ModelConfig
from gpuworker.models.gemma3.model import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM
from gpuworker.models.gemma3.vision import MultiModalProjector, SiglipVisionTower
from gpuworker.models.llama import LlamaForCausalLM
from gpuworker.models.tensor_parallel import ParallelContext


@dataclass(frozen=True)
class ImageBlock:
    """An image whose last token is in the step: its rows [row, row + count) of the step (its
    tokens not already cached), the sequence's index in the batch and the image's last position."""

    seq_index: int
    row: int
    count: int
    last_position: int


def attend_within_images(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    blocks: list[ImageBlock],
    scale: float,
    window: int | None,
    k_scale: float,
    v_scale: float,
) -> None:
    """Overwrite out's image rows with attention over every key up to their image's last token."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    key_cache = kv_cache[0].view(num_blocks * block_size, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(num_blocks * block_size, num_kv_heads, head_dim)
    group = query.shape[1] // num_kv_heads
    device = query.device
    for block in blocks:
        first_query = block.last_position - block.count + 1
        first_key = 0 if window is None else max(0, first_query - window + 1)
        key_pos = torch.arange(first_key, block.last_position + 1, device=device)
        table = meta.block_tables[block.seq_index].long()
        slots = table[key_pos // block_size] * block_size + key_pos % block_size
        keys = dequantize_kv(key_cache[slots], k_scale).float().repeat_interleave(group, dim=1)
        values = dequantize_kv(value_cache[slots], v_scale).float().repeat_interleave(group, dim=1)
        rows = slice(block.row, block.row + block.count)
        scores = torch.einsum("qhd,khd->hqk", query[rows].float(), keys) * scale
        if window is not None:
            query_pos = torch.arange(first_query, block.last_position + 1, device=device)
            scores = scores.masked_fill(key_pos[None, None, :] <= query_pos[None, :, None] - window, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)


class Gemma3ImageAttention(Gemma3Attention):
    def forward(self, positions, x, kv_cache, meta, backend, image_blocks=None):
        if not image_blocks:
            return super().forward(positions, x, kv_cache, meta, backend)
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        windowed = getattr(meta, "windowed", None)
        if self.window is not None and windowed is not None:
            meta = windowed
        # Rotated here (not in a fused launch): the image rows' queries are needed rotated.
        q, k = self._rotary[0](positions, q, k)
        kwargs = dict(k_scale=self.k_scale, v_scale=self.v_scale, sliding_window=self.window)
        if fuses_rotary_and_cache_write(backend):
            backend = _Unfused(backend)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale, **kwargs)
        attend_within_images(out, q, kv_cache, meta, image_blocks, self.scale, self.window, self.k_scale, self.v_scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class _Unfused:
    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def forward(self, *args, **kwargs):
        return self.backend.forward(*args, **kwargs)


class Gemma3ImageDecoderLayer(Gemma3DecoderLayer):
    def forward(self, positions, hidden, kv_cache, meta, backend, image_blocks=None):
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta, backend, image_blocks)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma3ForCausalLM's forward with image_rows/image_embeds/image_blocks, and encode_images."""

    checkpoint_prefix = "language_model."  # the text decoder's tensors sit under it
    attends_within_images = True  # the runner passes image_blocks

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, parallel: ParallelContext | None = None
    ) -> None:
        super().__init__(config, attn_backend, parallel)
        for layer in self.layers:
            layer.__class__ = Gemma3ImageDecoderLayer
            layer.self_attn.__class__ = Gemma3ImageAttention
        self.vision_tower = SiglipVisionTower(config.vision)
        self.multi_modal_projector = MultiModalProjector(config.vision, config.hidden_size)
        for param in [*self.vision_tower.parameters(), *self.multi_modal_projector.parameters()]:
            param.requires_grad_(False)

    # transformers' Gemma3ForConditionalGeneration does not softcap its logits (only Gemma3ForCausalLM does).
    compute_logits = LlamaForCausalLM.compute_logits
    greedy_tokens = LlamaForCausalLM.greedy_tokens

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, grids: list) -> torch.Tensor:
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        tokens = self.multi_modal_projector(self.vision_tower(pixel_values.to(dtype)))
        return tokens.reshape(-1, tokens.shape[-1])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        image_blocks: list[ImageBlock] | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens[input_ids]
        hidden = hidden * self.embed_scale(hidden.dtype)
        if image_rows is not None:
            hidden = hidden.index_copy(0, image_rows, image_embeds.to(hidden.dtype))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta, self.attn_backend, image_blocks)
        return self.norm(hidden)
