"""Multi-head latent attention (DeepSeek-V2/V3) read from config.json: the low-rank shapes, the rotary
layout and YaRN scaling, resolved once as transformers resolves them.

Kept apart from the llama-style fields: ModelConfig carries an MLAConfig (ModelConfig.mla) for these
families and None for the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class YarnRope:
    """YaRN rotary scaling with DeepSeek's mscale terms (transformers' _compute_yarn_parameters)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float | None
    mscale_all_dim: float | None
    attention_factor: float | None
    truncate: bool


@dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int
    q_lora_rank: int | None  # None: queries come from one q_proj
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    yarn: YarnRope | None
    # Rotary pairs are adjacent dimensions (2i, 2i + 1) (DeepSeek's layout; V2 always, V3 by
    # rope_interleave), else the two halves of the rotary dimensions (rotate-half).
    rope_interleave: bool
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared
    rotary_scale: float  # YaRN's attention factor applied to cos and sin (1.0 without YaRN)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token and layer: the normalised latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def parse_mla(config: dict[str, Any], max_pos: int, source: str) -> MLAConfig:
    def positive(key: str, value: Any) -> int:
        if value is None:
            raise ValueError(f"{source}: missing required field {key!r} for multi-head latent attention")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
        return value

    shapes = {key: positive(key, config.get(key)) for key in _REQUIRED}
    q_lora_rank = config.get("q_lora_rank")
    if q_lora_rank is not None:
        q_lora_rank = positive("q_lora_rank", q_lora_rank)
    if shapes["qk_rope_head_dim"] % 2:
        raise ValueError(f"{source}: qk_rope_head_dim must be even, got {shapes['qk_rope_head_dim']}")
    theta, yarn = _rope(config, max_pos, source)
    qk_head_dim = shapes["qk_nope_head_dim"] + shapes["qk_rope_head_dim"]
    scale, rotary_scale = qk_head_dim**-0.5, 1.0
    if yarn is not None:
        if yarn.mscale_all_dim:
            mscale = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
            scale = scale * mscale * mscale
        rotary_scale = yarn.attention_factor
        if rotary_scale is None:
            if yarn.mscale and yarn.mscale_all_dim:
                rotary_scale = yarn_get_mscale(yarn.factor, yarn.mscale) / yarn_get_mscale(
                    yarn.factor, yarn.mscale_all_dim
                )
            else:
                rotary_scale = yarn_get_mscale(yarn.factor)
    # transformers' DeepseekV2 always rotates interleaved pairs; V3 reads rope_interleave (default true).
    interleave = config.get("rope_interleave")
    return MLAConfig(
        q_lora_rank=q_lora_rank,
        rope_theta=theta,
        yarn=yarn,
        rope_interleave=True if interleave is None else bool(interleave),
        softmax_scale=scale,
        rotary_scale=float(rotary_scale),
        **shapes,
    )


def _rope(config: dict[str, Any], max_pos: int, source: str) -> tuple[float, YarnRope | None]:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("yarn", "deepseek_yarn"):
        raise ValueError(
            f"{source}: rope type {rope_type!r} is not supported for DeepSeek models (expected 'default' or 'yarn')"
        )
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"{source}: yarn rope scaling needs 'original_max_position_embeddings'")
    factor = params.get("factor")
    # As transformers: without a factor, the ratio of the served context to the pretrained one.
    factor = max_pos / original if factor is None else factor
    optional = {key: params.get(key) for key in ("mscale", "mscale_all_dim", "attention_factor")}
    return theta, YarnRope(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        **optional,
    )
