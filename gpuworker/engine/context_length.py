"""The context an engine serves: max_model_len against the model's trained positions.

A max_model_len past the model's max_position_embeddings is refused unless the operator sets
allow_long_context: positions beyond the trained context use the same rotary frequencies (a llama3
rope_scaling keeps its original_max_position_embeddings), so the model runs but its quality there is
the operator's call. With the override the rotary table covers every position served.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from gpuworker.engine.config import EngineConfig
from gpuworker.models.config import ModelConfig

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """config.max_model_len, or the model's max_position_embeddings where it is None; a value past
    the model's positions only with config.allow_long_context (and a warning)."""
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len <= mc.max_position_embeddings:
        return max_model_len
    if not config.allow_long_context:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's context ({mc.max_position_embeddings} positions); "
            "set allow_long_context to serve past it"
        )
    logger.warning(
        "max_model_len %d exceeds the model's context of %d positions (allow_long_context): "
        "output quality past position %d is not what the model was trained for",
        max_model_len,
        mc.max_position_embeddings,
        mc.max_position_embeddings,
    )
    return max_model_len


def with_context(mc: ModelConfig, max_model_len: int) -> ModelConfig:
    """mc with positions for max_model_len tokens (its rotary table sized to hold them)."""
    if max_model_len <= mc.max_position_embeddings:
        return mc
    return replace(mc, max_position_embeddings=max_model_len)
