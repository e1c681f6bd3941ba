"""Qwen2.5-VL's part of config.json: the vision tower's shapes, the image token ids and the
multimodal rotary sections, checked as transformers' Qwen2_5_VLConfig reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionLayout:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int | None
    mrope_section: tuple[int, int, int]  # rotary frequency pairs driven by time, height, width

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Pixel values of one patch row (channels x frames x patch x patch)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's fields: text_config over the top level (older checkpoints keep them flat)."""
    merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    merged.update(config.get("text_config") or {})
    for key in ("tie_word_embeddings", "architectures"):
        if key in config:
            merged[key] = config[key]
    return merged


def parse_vision(config: dict[str, Any], head_dim: int, source: str) -> VisionLayout:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"{source}: vision_config is missing")

    def positive(key: str, default: Any = None) -> int:
        value = vision.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{source}: vision_config.{key} must be a positive integer, got {value!r}")
        return value

    act = vision.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: vision_config.hidden_act {act!r} is not supported (expected 'silu')")
    hidden, heads = positive("hidden_size"), positive("num_heads")
    if hidden % heads or (hidden // heads) % 4:
        raise ValueError(f"{source}: vision_config.hidden_size / num_heads must be a multiple of 4")
    depth = positive("depth")
    full = tuple(vision.get("fullatt_block_indexes") or ())
    if any(not isinstance(i, int) or not 0 <= i < depth for i in full):
        raise ValueError(f"{source}: vision_config.fullatt_block_indexes must index blocks below depth {depth}")
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = tuple(rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(
            f"{source}: rope_parameters.mrope_section must be three sizes summing to head_dim / 2 "
            f"({head_dim // 2}), got {list(section)!r}"
        )
    image_token_id = config.get("image_token_id")
    if not isinstance(image_token_id, int):
        raise ValueError(f"{source}: image_token_id must be an integer, got {image_token_id!r}")
    rope_theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return VisionLayout(
        depth=depth,
        hidden_size=hidden,
        num_heads=heads,
        intermediate_size=positive("intermediate_size"),
        out_hidden_size=positive("out_hidden_size"),
        patch_size=positive("patch_size", 14),
        temporal_patch_size=positive("temporal_patch_size", 2),
        spatial_merge_size=positive("spatial_merge_size", 2),
        window_size=positive("window_size", 112),
        fullatt_block_indexes=full,
        in_channels=positive("in_channels", 3),
        rope_theta=float(rope_theta),
        image_token_id=image_token_id,
        vision_start_token_id=config.get("vision_start_token_id"),
        mrope_section=section,
    )
