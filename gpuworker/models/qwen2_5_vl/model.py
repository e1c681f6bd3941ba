"""Qwen2_5_VLForConditionalGeneration: the llama path's Qwen2 decoder with multimodal rotary
positions, and the vision transformer whose output replaces the prompt's image tokens.

Positions come as [T] (text: all three rotary sections at one position, the plain rotary) or as
[3, T] (a prefill with image tokens: time, height and width positions, engine.multimodal computes
them). A backend that fuses rotary into its launches takes the [3, T] form as one row of cos/sin
per token (gathered once per step, shared by the layers) at positions 0..T-1, so a prefill with
images runs the same rotary, cache-write and attention launches as text.
"""

from __future__ import annotations

import torch

from gpuworker.attention.backend import AttentionBackend, AttentionMetadata, fuses_rotary_and_cache_write
from gpuworker.models.config import ModelConfig
from gpuworker.models.layers import RotaryEmbedding, _rotate
from gpuworker.models.llama import LlamaForCausalLM
from gpuworker.models.qwen2_5_vl.vision import Grid, VisionTransformer
from gpuworker.models.tensor_parallel import ParallelContext, active


class MultimodalRotary(RotaryEmbedding):
    """Rotary whose frequency pairs take their position from one of three rows (mrope_section)."""

    def __init__(self, config: ModelConfig, section: tuple[int, int, int]) -> None:
        super().__init__(config.rotary_width, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        self.section = section

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        cos, sin = self.tables(positions)
        cos = cos.to(query.dtype).unsqueeze(1)
        sin = sin.to(query.dtype).unsqueeze(1)
        return _rotate(query, cos, sin, self.head_dim), _rotate(key, cos, sin, self.head_dim)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] -> each token's cos and sin [T, rot_dim // 2] (float32, as the caches)."""
        # Filled on the device: a host tensor would be a copy the host waits for, every step.
        rows = torch.cat(
            [torch.full((n,), i, dtype=torch.long, device=positions.device) for i, n in enumerate(self.section)]
        )
        per_pair = positions[rows].T  # [T, rot_dim / 2]: each pair's position
        pairs = torch.arange(per_pair.shape[1], device=positions.device)
        return self.cos_cache[per_pair, pairs].contiguous(), self.sin_cache[per_pair, pairs].contiguous()


class _PerTokenRotary:
    """A fused backend handed each token's own cos/sin rows (MultimodalRotary.tables): its launches
    read token t's row at position t, whatever cos/sin cache and positions the layer passes."""

    fuses_rotary_and_cache_write = True

    def __init__(self, backend: AttentionBackend, rotary: MultimodalRotary, positions: torch.Tensor) -> None:
        self.backend = backend
        self.rows = torch.arange(positions.shape[1], device=positions.device)
        self.cos, self.sin = rotary.tables(positions)

    def forward_with_rotary(self, positions, query, key, value, kv_cache, meta, scale, cos_cache, sin_cache, **kw):
        return self.backend.forward_with_rotary(
            self.rows, query, key, value, kv_cache, meta, scale, self.cos, self.sin, **kw
        )


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """forward(input_ids, positions [T] or [3, T], kv_caches, meta, image_rows, image_embeds) -> hidden;
    encode_images(pixel_values, grids) -> the images' embeddings, one row per image token."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, parallel: ParallelContext | None = None
    ) -> None:
        if active(parallel) is not None:
            raise ValueError(f"{config.architecture} does not run tensor-parallel; use one GPU")
        super().__init__(config, attn_backend, None)
        layout = config.vision
        self.rotary = MultimodalRotary(config, layout.mrope_section)
        for layer in self.layers:
            layer.self_attn._rotary = (self.rotary,)
        self.visual = VisionTransformer(layout)

    @property
    def image_token_id(self) -> int:
        return self.config.vision.image_token_id

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        dtype = self.visual.patch_embed.proj.weight.dtype
        return self.visual(pixel_values.to(dtype), grids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens[input_ids]
        if image_rows is not None:
            hidden = hidden.index_copy(0, image_rows, image_embeds.to(hidden.dtype))
        backend = self.attn_backend
        if positions.dim() == 2 and fuses_rotary_and_cache_write(backend):
            backend = _PerTokenRotary(backend, self.rotary, positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, backend)
        return self.norm(hidden, residual)[0]
