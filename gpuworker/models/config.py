"""ModelConfig: a Hugging Face config.json parsed and checked once, for the llama-style families.

Everything the decoder needs is resolved here (head_dim, biases, q/k norms, rope), so the model code
never looks at architecture names. Fields a family does not support are rejected with a ValueError
naming the file and the field, rather than silently computing something different from transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuworker.architectures import MODEL_TYPES as _MODEL_TYPES
from gpuworker.checkpoint_quantization import QuantConfig, parse_quantization
from gpuworker.kernels.moe.grouped_routing import TOPK_METHODS, GroupedRouting
from gpuworker.models.deepseek.config import MLAConfig, parse_mla

# Per architecture: whether q/k/v and o_proj carry biases ("config" = the config's attention_bias,
# another string = that config field, true when absent), whether q/k get a per-head RMSNorm before
# rotary (Qwen3; a string: that config field, false when absent), the mixture-of-experts layout if
# any (_MOE_LAYOUTS), and whether partial_rotary_factor is honoured (rotary on the first
# head_dim * factor dims of each head; "default": the factor when the config has none).
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": "config", "o_bias": "config", "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": "config", "o_bias": "config", "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": "config", "o_bias": "config", "qk_norm": True},
    "MixtralForCausalLM": {"qkv_bias": "config", "o_bias": "config", "qk_norm": False, "moe": "mixtral"},
    "Qwen2MoeForCausalLM": {"qkv_bias": "qkv_bias", "o_bias": False, "qk_norm": False, "moe": "qwen_moe"},
    "Qwen3MoeForCausalLM": {"qkv_bias": "config", "o_bias": "config", "qk_norm": True, "moe": "qwen_moe"},
    "Glm4MoeForCausalLM": {
        "qkv_bias": "config",
        "o_bias": False,
        "qk_norm": "use_qk_norm",
        "moe": "deepseek",
        "partial_rotary": 0.5,
    },
    # Multi-head latent attention (models.deepseek): the attention shapes live in ModelConfig.mla.
    "DeepseekV2ForCausalLM": {"qkv_bias": False, "o_bias": "config", "qk_norm": False, "moe": "deepseek", "mla": True},
    "DeepseekV3ForCausalLM": {"qkv_bias": False, "o_bias": "config", "qk_norm": False, "moe": "deepseek", "mla": True},
    # Gemma 3's text decoder: its layout (norms, activation, sliding layers, rope per layer type) is
    # parsed by models.gemma3.config into ModelConfig.gemma3.
    "Gemma3ForCausalLM": {"qkv_bias": "config", "o_bias": "config", "qk_norm": True, "gemma3": True},
    # Qwen2.5-VL: the Qwen2 decoder under text_config, the vision tower parsed by
    # models.qwen2_5_vl.config into ModelConfig.vision.
    "Qwen2_5_VLForConditionalGeneration": {"qkv_bias": True, "o_bias": False, "qk_norm": False, "vision": "qwen2_5_vl"},
    # Gemma 3 with its SigLIP tower (models.gemma3.vision) over the Gemma 3 text decoder.
    "Gemma3ForConditionalGeneration": {
        "qkv_bias": "config",
        "o_bias": "config",
        "qk_norm": True,
        "gemma3": True,
        "vision": "siglip",
    },
}
# Checkpoint names of a MoE block: its module under model.layers.N, and each expert's gate, up and
# down projections under <module>.experts.E.
_MOE_LAYOUTS = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP: each token's top_k experts of num_experts (SiLU-gated MLPs
    of expert_intermediate_size), weighted by the router's softmax over all experts, renormalised
    over the chosen ones when norm_topk_prob; plus, where the family has one, a shared expert that
    every token passes through, scaled by sigmoid(shared_expert_gate(x)).

    DeepSeek-V2/V3 and GLM-4.5 (deepseek_moe_config builds theirs): `routing` says how the router
    chooses and weighs (kernels.moe.routing: softmax or sigmoid, grouped top-k, routed scaling), from
    logits computed in float32 with a float32 router weight; with router_bias, its float32
    e_score_correction_bias shifts the choice only; the shared experts are ungated
    (shared_expert_gated False) and added to the routed output."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: none
    sparse_layers: tuple[bool, ...]  # per layer: MoE, or the dense MLP of intermediate_size
    checkpoint_prefix: str
    expert_names: tuple[str, str, str]  # gate, up, down
    routing: GroupedRouting | None = None  # None: the softmax top-k above
    router_bias: bool = False  # the router has an e_score_correction_bias [num_experts]
    router_float32: bool = False  # router weight kept, and logits computed, in float32
    shared_expert_gated: bool = True
    shared_expert_name: str = "shared_expert"  # its module under the block


SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # The longest context served exactly: config.json's value, capped at the sliding window where
    # one is active on every layer (Mistral, Qwen2 with use_sliding_window), whose attention we run
    # over the whole context and so equals sliding-window attention only up to the window. Gemma 3's
    # sliding layers attend through their window (layer_windows), so its value is not capped.
    max_position_embeddings: int
    rms_norm_eps: float
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    tie_word_embeddings: bool
    rope_theta: float
    # None for plain rotary; else {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}.
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # q/k/v projections carry biases
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"
    sliding_window: int | None = None
    moe: MoEConfig | None = None
    # Rotary on the first rotary_dim dims of each head only (GLM's partial_rotary_factor); None: all.
    rotary_dim: int | None = None
    # The checkpoint's quantization (config.json's quantization_config), or FP8 chosen at load.
    quantization: QuantConfig | None = None
    # Gemma 3's layout (models.gemma3.config.Gemma3Layout); None for the llama-style families.
    gemma3: Any = None
    # The checkpoint directory the weights and tokenizer are read from (set by load_model_config).
    model_path: str | None = None
    # Multi-head latent attention (DeepSeek-V2/V3); None for the llama-style attention.
    mla: MLAConfig | None = None
    # A vision model's tower and image tokens (models.qwen2_5_vl.config.VisionLayout); None: text only.
    vision: Any = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_width(self) -> int:
        """How many leading dims of each head rotary rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(planes, heads, width) of one layer's cached token: keys and values of each KV head, or
        with latent attention one plane of one row, the latent and the rotated shared key."""
        if self.mla is not None:
            return 1, 1, self.mla.cache_width
        return 2, self.num_kv_heads, self.head_dim

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: the sliding window its attention keeps (keys at positions > p - window for a
        query at p), or None for attention over the whole context."""
        if self.gemma3 is None:
            return (None,) * self.num_layers
        return self.gemma3.layer_windows

    @classmethod
    def from_hf(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None, source: str = "config.json"
    ) -> ModelConfig:
        """Build from config.json's dict (and generation_config.json's, for extra EOS ids)."""
        architecture = _architecture(config, source)
        family = _FAMILIES[architecture]
        vision_source = None
        if family.get("vision"):
            from gpuworker.models.qwen2_5_vl.config import text_config

            vision_source, config = config, text_config(config)

        def need(key: str, kind: type = int) -> Any:
            value = config.get(key)
            if value is None:
                raise ValueError(f"{source}: missing required field {key!r} for {architecture}")
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
            return value

        hidden_size = need("hidden_size")
        num_heads = need("num_attention_heads")
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = config.get("head_dim") or hidden_size // num_heads
        if head_dim % 2 != 0 and not family.get("mla"):
            raise ValueError(f"{source}: head_dim must be even for rotary embeddings, got {head_dim}")
        vision = None
        if family.get("vision") == "siglip":
            from gpuworker.models.gemma3.vision import parse_siglip

            vision = parse_siglip(vision_source, source)
        elif vision_source is not None:
            from gpuworker.models.qwen2_5_vl.config import parse_vision

            vision = parse_vision(vision_source, head_dim, source)
        gemma3 = None
        if family.get("gemma3"):
            from gpuworker.models.gemma3.config import parse_gemma3

            gemma3 = parse_gemma3(config, need("num_hidden_layers"), source)
        else:
            hidden_act = config.get("hidden_act", "silu")
            if hidden_act != "silu":
                raise ValueError(f"{source}: hidden_act {hidden_act!r} is not supported (expected 'silu')")
        if config.get("pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"{source}: pretraining_tp must be 1, got {config['pretraining_tp']}")

        max_pos = need("max_position_embeddings")
        mla, rotary_dim = None, None
        if family.get("mla"):
            mla = parse_mla(config, max_pos, source)
            # Each head's query and key: the position-free part and the rotary part.
            head_dim, num_kv_heads = mla.qk_head_dim, num_heads
            rope_theta, rope_scaling, sliding_window = mla.rope_theta, None, None
        elif gemma3 is None:
            rope_theta, rope_scaling = _rope(config, max_pos, source)
            sliding_window = _sliding_window(config, architecture)
        else:
            rope_theta, rope_scaling, sliding_window = gemma3.rope_theta, gemma3.rope_scaling, None
        if mla is None:
            rotary_dim = _rotary_dim(config, family.get("partial_rotary"), head_dim, source)
        attention_bias = bool(config.get("attention_bias", False))

        def bias(rule: Any) -> bool:
            if rule == "config":
                return attention_bias
            return bool(config.get(rule, True)) if isinstance(rule, str) else bool(rule)

        num_layers = need("num_hidden_layers")

        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
        return cls(
            architecture=architecture,
            model_type=config.get("model_type", ""),
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=min(max_pos, sliding_window) if sliding_window else max_pos,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            eos_token_ids=_eos_ids(config, generation_config),
            bos_token_id=config.get("bos_token_id"),
            pad_token_id=config.get("pad_token_id"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma3 is not None)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=bias(family["qkv_bias"]),
            o_proj_bias=bias(family["o_bias"]),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=bool(config.get(family["qk_norm"], False))
            if isinstance(family["qk_norm"], str)
            else family["qk_norm"],
            torch_dtype=str(dtype).removeprefix("torch."),
            sliding_window=sliding_window,
            rotary_dim=rotary_dim,
            moe=_moe(config, family.get("moe"), num_layers, need, source),
            quantization=parse_quantization(config, source),
            mla=mla,
            gemma3=gemma3,
            vision=vision,
            extra={
                "config_max_position_embeddings": max_pos,
                "num_nextn_predict_layers": int(config.get("num_nextn_predict_layers") or 0),
            },
        )


def _moe(config: dict[str, Any], layout: str | None, num_layers: int, need: Any, source: str) -> MoEConfig | None:
    if layout is None:
        return None
    if layout == "deepseek":
        if _all_dense(config, num_layers):
            return None  # its expert fields (which transformers leaves unset then) are never used
        return deepseek_moe_config(config, num_layers, source)
    prefix, names = _MOE_LAYOUTS[layout]
    if layout == "mixtral":
        num_experts, expert_size = need("num_local_experts"), need("intermediate_size")
        norm_topk_prob, shared, sparse = True, 0, (True,) * num_layers
    else:
        # Published checkpoints say num_experts; transformers 5 writes num_local_experts for both.
        num_experts = need("num_experts" if "num_experts" in config else "num_local_experts")
        expert_size = need("moe_intermediate_size")
        norm_topk_prob = bool(config.get("norm_topk_prob", False))
        shared = config.get("shared_expert_intermediate_size") or 0
        step = config.get("decoder_sparse_step") or 1
        dense = set(config.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    top_k = need("num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"{source}: num_experts_per_tok ({top_k}) exceeds the {num_experts} experts")
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=expert_size,
        norm_topk_prob=norm_topk_prob,
        shared_expert_intermediate_size=shared,
        sparse_layers=sparse,
        checkpoint_prefix=prefix,
        expert_names=names,
    )


# Per model type: transformers' defaults of the DeepSeek-style MoE fields a config.json may omit.
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
    },
    "deepseek_v3": {
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
    },
    "glm4_moe": {
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
    },
}


def deepseek_moe_config(
    config: dict[str, Any], num_layers: int | None = None, source: str = "config.json"
) -> MoEConfig:
    """The MoE of a DeepSeek-V2, DeepSeek-V3 or GLM-4.5 config.json dict (model_type deepseek_v2,
    deepseek_v3 or glm4_moe; fields it omits take transformers' defaults for that type), as
    transformers builds it: layers first_k_dense_replace.. are sparse (the others the dense MLP of
    intermediate_size); n_routed_experts experts of moe_intermediate_size, num_experts_per_tok per
    token, routed by topk_method (scoring_func, if given, must be the one it takes), n_group,
    topk_group, norm_topk_prob and routed_scaling_factor; n_shared_experts * moe_intermediate_size of
    ungated shared experts under mlp.shared_experts. Bad values raise a ValueError naming the field."""
    model_type = config.get("model_type")
    if model_type not in _DEEPSEEK_DEFAULTS:
        raise ValueError(f"{source}: model_type must be one of {', '.join(_DEEPSEEK_DEFAULTS)}, got {model_type!r}")
    defaults = _DEEPSEEK_DEFAULTS[model_type]

    def field(key: str, kinds: tuple[type, ...] = (int,), minimum: float = 1) -> Any:
        value = config.get(key)
        value = defaults.get(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, kinds) or value < minimum:
            raise ValueError(
                f"{source}: {key} must be a number >= {minimum} of type {kinds[0].__name__}, got {value!r}"
            )
        return value

    num_layers = field("num_hidden_layers") if num_layers is None else num_layers
    num_experts = field("n_routed_experts" if "n_routed_experts" in config else "num_local_experts")
    inter, shared = field("moe_intermediate_size"), field("n_shared_experts", minimum=0)
    first_dense = field("first_k_dense_replace", minimum=0)
    if first_dense > num_layers:
        raise ValueError(f"{source}: first_k_dense_replace ({first_dense}) exceeds num_hidden_layers ({num_layers})")
    if config.get("moe_layer_freq", 1) != 1:
        raise ValueError(
            f"{source}: moe_layer_freq must be 1 (transformers has no other), got {config['moe_layer_freq']!r}"
        )
    method = config.get("topk_method") or defaults["topk_method"]
    if method not in TOPK_METHODS:
        raise ValueError(f"{source}: topk_method must be one of {', '.join(TOPK_METHODS)}, got {method!r}")
    scoring = config.get("scoring_func", TOPK_METHODS[method])
    if scoring != TOPK_METHODS[method]:
        raise ValueError(
            f"{source}: scoring_func {scoring!r} does not fit topk_method {method!r}, which takes "
            f"{TOPK_METHODS[method]!r}"
        )
    normalize = config.get("norm_topk_prob", defaults["norm_topk_prob"])
    if model_type == "deepseek_v2" and normalize:
        raise ValueError(f"{source}: norm_topk_prob: transformers' DeepSeek-V2 router does not renormalise")
    n_group = field("n_group") if method != "greedy" else 1
    routing = GroupedRouting(
        top_k=field("num_experts_per_tok"),
        topk_method=method,
        n_group=n_group,
        topk_group=field("topk_group") if method != "greedy" else n_group,
        normalize=bool(normalize),
        scaling=float(field("routed_scaling_factor", (int, float), minimum=0)),
    )
    try:
        routing.check(num_experts)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return MoEConfig(
        num_experts=num_experts,
        top_k=routing.top_k,
        expert_intermediate_size=inter,
        norm_topk_prob=routing.normalize,
        shared_expert_intermediate_size=shared * inter,
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        checkpoint_prefix=_MOE_LAYOUTS["deepseek"][0],
        expert_names=_MOE_LAYOUTS["deepseek"][1],
        routing=routing,
        router_bias=method == "noaux_tc",
        router_float32=True,
        shared_expert_gated=False,
        shared_expert_name="shared_experts",
    )


def _all_dense(config: dict[str, Any], num_layers: int) -> bool:
    """A DeepSeek-style config whose first_k_dense_replace is every layer: no MoE at all (a larger
    value is deepseek_moe_config's error to report)."""
    first = config.get("first_k_dense_replace")
    if first is None:
        first = _DEEPSEEK_DEFAULTS.get(config.get("model_type"), {}).get("first_k_dense_replace", 0)
    return isinstance(first, int) and not isinstance(first, bool) and first == num_layers


def _rotary_dim(config: dict[str, Any], default_factor: float | None, head_dim: int, source: str) -> int | None:
    """The rotated width for partial_rotary_factor (transformers: int(head_dim * factor)); None for
    the whole head. Families without partial rotary (default_factor None) accept only 1.0."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if default_factor is None:
        if factor not in (None, 1.0):
            raise ValueError(f"{source}: partial_rotary_factor other than 1.0 is not supported")
        return None
    factor = default_factor if factor is None else factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"{source}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"{source}: partial_rotary_factor {factor} rotates {dim} of {head_dim} dims; it must be even")
    return None if dim == head_dim else dim


def _architecture(config: dict[str, Any], source: str) -> str:
    architectures = config.get("architectures") or []
    if not architectures and config.get("model_type") in _MODEL_TYPES:
        architectures = [_MODEL_TYPES[config["model_type"]]]
    for name in architectures:
        if name in _FAMILIES:
            return name
    raise ValueError(
        f"{source}: unsupported architecture {architectures or config.get('model_type')!r}; "
        f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(config: dict[str, Any], max_pos: int, source: str) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 saves everything under rope_parameters; 4.x used rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{source}: per-layer-type rope_parameters are not supported")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported (expected 'default' or 'llama3')")
    scaling: dict[str, Any] = {"rope_type": "llama3"}
    for key in _LLAMA3_KEYS:
        # transformers falls back to max_position_embeddings for the original context too.
        value = params.get(key, max_pos if key == "original_max_position_embeddings" else None)
        if value is None:
            raise ValueError(f"{source}: llama3 rope scaling needs {key!r}")
        scaling[key] = value
    return float(theta), scaling


def _sliding_window(config: dict[str, Any], architecture: str) -> int | None:
    window = config.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not config.get("use_sliding_window"):
        return None
    return int(window) if window else None


def _eos_ids(config: dict[str, Any], generation_config: dict[str, Any] | None) -> list[int]:
    ids: list[int] = []
    for source in (config, generation_config or {}):
        value = source.get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids
