"""Gemma 3's image path (transformers' Gemma3ForConditionalGeneration): a SigLIP vision tower at its
image size, then the multimodal projector (average pooling to mm_tokens_per_image tokens, Gemma's
RMSNorm, a projection into the text width). config.json's vision fields are checked here too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuworker.models.gemma3.layers import GemmaRMSNorm


@dataclass(frozen=True)
class SiglipLayout:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    tokens_per_image: int
    image_token_id: int
    # <start_of_image> and <end_of_image>: Gemma 3's chat template writes the first alone for each
    # image, and its processor puts "\n\n<start_of_image>" + image tokens + "<end_of_image>\n\n" there.
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patch_values(self) -> int:
        """Pixel values of one patch (channels x patch x patch)."""
        return self.num_channels * self.patch_size**2


def parse_siglip(config: dict[str, Any], source: str) -> SiglipLayout:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"{source}: vision_config is missing")

    def positive(key: str, default: Any = None, where: dict = vision, prefix: str = "vision_config.") -> int:
        value = where.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{source}: {prefix}{key} must be a positive integer, got {value!r}")
        return value

    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{source}: vision_config.hidden_act {act!r} is not supported (expected 'gelu_pytorch_tanh')")
    if vision.get("vision_use_head"):
        raise ValueError(f"{source}: vision_config.vision_use_head is not supported (Gemma 3 uses no pooling head)")
    image_size, patch = positive("image_size", 896), positive("patch_size", 14)
    tokens = positive("mm_tokens_per_image", 256, config, "")
    side = int(round(tokens**0.5))
    if image_size % patch or side * side != tokens or (image_size // patch) % side:
        raise ValueError(
            f"{source}: mm_tokens_per_image ({tokens}) must be a square whose side divides "
            f"vision_config.image_size / patch_size ({image_size} / {patch})"
        )
    image_token_id = config.get("image_token_index", config.get("image_token_id"))
    if not isinstance(image_token_id, int):
        raise ValueError(f"{source}: image_token_index must be an integer, got {image_token_id!r}")
    hidden, heads = positive("hidden_size"), positive("num_attention_heads")
    if hidden % heads:
        raise ValueError(f"{source}: vision_config.hidden_size must be a multiple of num_attention_heads")
    return SiglipLayout(
        hidden_size=hidden,
        intermediate_size=positive("intermediate_size"),
        num_layers=positive("num_hidden_layers"),
        num_heads=heads,
        image_size=image_size,
        patch_size=patch,
        num_channels=positive("num_channels", 3),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
        tokens_per_image=tokens,
        image_token_id=image_token_id,
        boi_token_id=_token_id(config, "boi_token_index", source),
        eoi_token_id=_token_id(config, "eoi_token_index", source),
    )


def _token_id(config: dict[str, Any], key: str, source: str) -> int | None:
    value = config.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{source}: {key} must be a token id, got {value!r}")
    return value


class SiglipAttention(nn.Module):
    def __init__(self, layout: SiglipLayout) -> None:
        super().__init__()
        h = layout.hidden_size
        self.num_heads = layout.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class SiglipLayer(nn.Module):
    def __init__(self, layout: SiglipLayout) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(layout.hidden_size, eps=layout.layer_norm_eps)
        self.self_attn = SiglipAttention(layout)
        self.layer_norm2 = nn.LayerNorm(layout.hidden_size, eps=layout.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(layout.hidden_size, layout.intermediate_size)
        self.mlp.fc2 = nn.Linear(layout.intermediate_size, layout.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh"))


class SiglipVisionTower(nn.Module):
    """pixel_values [B, C, S, S] -> [B, (S / patch)**2, hidden]: SiglipVisionModel's last hidden state."""

    def __init__(self, layout: SiglipLayout) -> None:
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(
            layout.num_channels, layout.hidden_size, layout.patch_size, stride=layout.patch_size
        )
        self.embeddings.position_embedding = nn.Embedding(layout.patches_per_side**2, layout.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipLayer(layout) for _ in range(layout.num_layers))
        self.post_layernorm = nn.LayerNorm(layout.hidden_size, eps=layout.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        x = x + self.embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class MultiModalProjector(nn.Module):
    """Vision tower output -> tokens_per_image rows of the text width."""

    def __init__(self, layout: SiglipLayout, text_hidden: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(layout.hidden_size, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(layout.hidden_size, layout.layer_norm_eps)
        self.side = layout.patches_per_side
        self.kernel = self.side // int(round(layout.tokens_per_image**0.5))

    def forward(self, vision: torch.Tensor) -> torch.Tensor:
        b, _, h = vision.shape
        grid = vision.transpose(1, 2).reshape(b, h, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, h)).view(b, -1, h)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(vision)
