"""Gemma 3's part of config.json: which layers slide, their window, rope per layer type, the
attention scale and the logit softcapping, checked as transformers' Gemma3TextConfig reads them.

transformers 5 writes `layer_types` and `rope_parameters` keyed by layer type; older checkpoints
carry `sliding_window_pattern` (every n-th layer full), `rope_theta`, `rope_local_base_freq` and
`rope_scaling` (the full layers'). Both are read. What we do not run (attention logit softcapping,
bidirectional attention, rope types other than default, linear and llama3) is refused with a
ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_LOCAL_THETA = 10_000.0
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Gemma3Layout:
    sliding_window: int
    sliding_layers: tuple[bool, ...]  # per layer: a sliding-window layer, else full attention
    rope_theta: float  # the full layers'
    rope_scaling: dict[str, Any] | None  # the full layers' (layers.rope_inv_freq's dict)
    local_rope_theta: float  # the sliding layers' (plain rotary)
    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    final_logit_softcapping: float | None  # logits = cap * tanh(logits / cap)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if sliding else None for sliding in self.sliding_layers)


def parse_gemma3(config: dict[str, Any], num_layers: int, source: str) -> Gemma3Layout:
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"{source}: hidden_activation {activation!r} is not supported (expected 'gelu_pytorch_tanh')")
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{source}: attn_logit_softcapping is not supported (set it to null)")
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention is not supported (causal attention only)")
    window = config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    scalar = config.get("query_pre_attn_scalar", DEFAULT_QUERY_PRE_ATTN_SCALAR)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
        raise ValueError(f"{source}: query_pre_attn_scalar must be a positive number, got {scalar!r}")
    softcap = config.get("final_logit_softcapping")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"{source}: final_logit_softcapping must be a positive number or null, got {softcap!r}")
    global_theta, scaling, local_theta = _rope(config, source)
    return Gemma3Layout(
        sliding_window=window,
        sliding_layers=_sliding_layers(config, num_layers, source),
        rope_theta=global_theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


def _sliding_layers(config: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    layer_types = config.get("layer_types")
    if layer_types is None:
        pattern = config.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise ValueError(f"{source}: sliding_window_pattern must be a positive integer, got {pattern!r}")
        return tuple(bool((i + 1) % pattern) for i in range(num_layers))
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"{source}: layer_types must list one type per layer ({num_layers}), got {layer_types!r}")
    unknown = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"{source}: layer_types holds unknown type(s) {unknown}; expected {' or '.join(LAYER_TYPES)}")
    return tuple(t == SLIDING for t in layer_types)


def _rope(config: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None, float]:
    """(the full layers' theta, their scaling, the sliding layers' theta)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{source}: rope_parameters has unknown layer type(s) {unknown}")
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
    else:
        full = dict(params or config.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", config.get("rope_theta", DEFAULT_GLOBAL_THETA))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", DEFAULT_LOCAL_THETA))
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(f"{source}: rope_parameters.{SLIDING}.rope_type {local_type!r} is not supported")
    return float(full["rope_theta"]), _scaling(full, config, source), float(local["rope_theta"])


def _scaling(params: dict[str, Any], config: dict[str, Any], source: str) -> dict[str, Any] | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"{source}: linear rope scaling needs a positive 'factor', got {factor!r}")
        return {"rope_type": "linear", "factor": float(factor)}
    if rope_type == "llama3":
        scaling: dict[str, Any] = {"rope_type": "llama3"}
        for key in _LLAMA3_KEYS:
            fallback = config.get("max_position_embeddings") if key == "original_max_position_embeddings" else None
            value = params.get(key, fallback)
            if value is None:
                raise ValueError(f"{source}: llama3 rope scaling needs {key!r}")
            scaling[key] = value
        return scaling
    raise ValueError(
        f"{source}: rope_parameters.{FULL}.rope_type {rope_type!r} is not supported "
        "(expected 'default', 'linear' or 'llama3')"
    )
