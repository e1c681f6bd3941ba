"""Gemma3ForConditionalGeneration: Gemma 3's text decoder (models.gemma3.model) whose image tokens
take the SigLIP tower's projected output, and whose image tokens attend bidirectionally within
their image, as transformers' Gemma 3 masks them: causal OR same image (and within the window on
the sliding layers).

The attention backend does the masking: the runner gives each image token its image's last
position (AttentionMetadata.span_ends) and the prefill attention sees keys up to it. The scheduler
never ends a prefill chunk inside such an image (MultimodalPrompt.whole_images), so those keys are
in the cache when the chunk attends.
"""

from __future__ import annotations

import torch

from gpuworker.attention.backend import AttentionBackend, AttentionMetadata
from gpuworker.models.config import ModelConfig
from gpuworker.models.gemma3.model import Gemma3ForCausalLM
from gpuworker.models.gemma3.vision import MultiModalProjector, SiglipVisionTower
from gpuworker.models.llama import LlamaForCausalLM
from gpuworker.models.tensor_parallel import ParallelContext


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma3ForCausalLM's forward with image_rows/image_embeds, and encode_images."""

    checkpoint_prefix = "language_model."  # the text decoder's tensors sit under it
    attends_within_images = True  # the runner sets the step's span_ends over its images

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, parallel: ParallelContext | None = None
    ) -> None:
        super().__init__(config, attn_backend, parallel)
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
    ) -> torch.Tensor:
        hidden = self.embed_tokens[input_ids]
        hidden = hidden * self.embed_scale(hidden.dtype)
        if image_rows is not None:
            hidden = hidden.index_copy(0, image_rows, image_embeds.to(hidden.dtype))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta, self.attn_backend)
        return self.norm(hidden)
