"""QuantConfig: a checkpoint's quantization, read once from config.json's quantization_config.

These published layouts are understood (the formats' own names in parentheses):
- FP8 e4m3 weights with a float32 scale per tensor or per output channel, and activations either
  left in the model dtype, quantized with a static per-tensor scale from the checkpoint, or quantized
  per token at run time: llm-compressor's "compressed-tensors" (format "float-quantized") and vLLM's
  "fp8" method (per-tensor scales, activation_scheme "static" or "dynamic").
- FP8 e4m3 weights with a float32 scale per block of weight_block_size [rows, columns] (the inverse
  of the quantizer's scale, "weight_scale_inv"), activations quantized at run time per token and per
  group of as many columns: DeepSeek's "fp8" method with weight_block_size (DeepSeek-V3/R1, Kimi K2;
  transformers' FineGrainedFP8).
- INT8 weights with a float32 scale per output channel (or per tensor) and activations quantized to
  INT8 per token at run time, both symmetric (W8A8): compressed-tensors' "int-quantized".
- INT4 weight-only with a scale and a zero point per group of input rows: "awq" (version "gemm") and
  "gptq" (checkpoint_format "gptq": zero points stored minus one; desc_act false).
`quantization="fp8"` at load quantizes a float checkpoint to FP8 with per-channel weight scales and
dynamic per-token activations (fp8_at_load).

Pure Python, outside gpuworker.models (whose package imports torch), so the engine's config and the
daemon can import it without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

METHODS = ("fp8", "int8", "awq", "gptq")
# Where the weights come from: a layout written by a quantizer, or a float checkpoint quantized at load.
FORMATS = ("compressed-tensors", "fp8", "awq", "gptq", "fp8-at-load")
# What a float checkpoint can be quantized to at load (EngineConfig.quantization; None: as it is).
LOAD_QUANTIZATIONS = (None, "fp8")


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8", "int8" (W8A8) or the INT4 "awq" / "gptq"
    checkpoint_format: str  # one of FORMATS
    # FP8: "tensor", "channel" or "block" weight scales; activations None (weight-only), "static" (per
    # tensor, the checkpoint's input_scale) or "dynamic" (per token, and per column group for "block").
    weight_strategy: str = "channel"
    activation_scheme: str | None = None
    # Block FP8: (weight rows, weight columns) per scale; the columns are also the activations' group.
    weight_block_size: tuple[int, int] | None = None
    # INT4: bits per weight, input rows per group, and whether zero points are stored (asymmetric).
    bits: int = 8
    group_size: int = 0
    zero_point: bool = False
    # Checkpoint module names left unquantized: exact names, or "re:" followed by a regex.
    ignore: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """A short name for pages and logs: "fp8", "int8", "awq-int4", "gptq-int4"."""
        return self.method if self.method in ("fp8", "int8") else f"{self.method}-int{self.bits}"

    def ignores(self, module_name: str) -> bool:
        """Whether the checkpoint module `module_name` (e.g. model.layers.0.self_attn.q_proj) is dense."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return True
            elif pattern == module_name or module_name.endswith("." + pattern):
                return True
        return False


def fp8_at_load() -> QuantConfig:
    return QuantConfig(
        method="fp8", checkpoint_format="fp8-at-load", weight_strategy="channel", activation_scheme="dynamic"
    )


def parse_quantization(config: dict[str, Any], source: str) -> QuantConfig | None:
    """config.json's quantization_config as a QuantConfig, None when absent; a ValueError naming the
    field for a layout we do not serve."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "fp8":
        return _vllm_fp8(qc, source)
    if method in ("awq", "gptq"):
        return _int4(qc, method, source)
    raise ValueError(
        f"{source}: quantization_config.quant_method {method!r} is not supported "
        "(expected 'compressed-tensors', 'fp8', 'awq' or 'gptq')"
    )


def _one_group_of_8_bit_weights(qc: dict[str, Any], where: str, kind: str) -> tuple[str, dict, str]:
    """compressed-tensors' one config group, whose weights are 8-bit `kind` ("float" or "int") with
    static per-tensor or per-channel scales: (the group's name, the group, the weights' strategy)."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}.config_groups must hold exactly one group, got {len(groups)}")
    ((name, group),) = groups.items()
    weights = group.get("weights") or {}
    if weights.get("num_bits") != 8 or weights.get("type") != kind:
        raise ValueError(
            f"{where}.config_groups.{name}.weights must be 8-bit {kind}, got "
            f"num_bits={weights.get('num_bits')!r} type={weights.get('type')!r}"
        )
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or weights.get("dynamic"):
        raise ValueError(
            f"{where}.config_groups.{name}.weights.strategy must be static 'tensor' or 'channel', got {strategy!r}"
        )
    return name, group, strategy


def _compressed_tensors(qc: dict[str, Any], source: str) -> QuantConfig:
    where = f"{source}: quantization_config"
    if qc.get("format") == "int-quantized":
        return _compressed_tensors_int8(qc, source)
    if qc.get("format") != "float-quantized":
        raise ValueError(
            f"{where}.format {qc.get('format')!r} is not supported (expected 'float-quantized' or 'int-quantized')"
        )
    name, group, strategy = _one_group_of_8_bit_weights(qc, where, "float")
    activations = group.get("input_activations")
    scheme = None
    if activations is not None:
        if activations.get("num_bits") != 8 or activations.get("type") != "float":
            raise ValueError(f"{where}.config_groups.{name}.input_activations must be 8-bit float")
        if activations.get("dynamic"):
            if activations.get("strategy") != "token":
                raise ValueError(
                    f"{where}.config_groups.{name}.input_activations: dynamic scales must be "
                    f"per 'token', got {activations.get('strategy')!r}"
                )
            scheme = "dynamic"
        elif activations.get("strategy") == "tensor":
            scheme = "static"
        else:
            raise ValueError(
                f"{where}.config_groups.{name}.input_activations: static scales must be per "
                f"'tensor', got {activations.get('strategy')!r}"
            )
    return QuantConfig(
        method="fp8",
        checkpoint_format="compressed-tensors",
        weight_strategy=strategy,
        activation_scheme=scheme,
        ignore=tuple(qc.get("ignore") or ()),
    )


def _compressed_tensors_int8(qc: dict[str, Any], source: str) -> QuantConfig:
    """compressed-tensors' "int-quantized": symmetric INT8 weights per channel (or tensor) and
    symmetric INT8 activations quantized per token at run time (W8A8)."""
    where = f"{source}: quantization_config"
    name, group, strategy = _one_group_of_8_bit_weights(qc, where, "int")
    weights = group["weights"]
    if not weights.get("symmetric", True):
        raise ValueError(f"{where}.config_groups.{name}.weights must be symmetric (no zero points)")
    activations = group.get("input_activations") or {}
    if (
        activations.get("num_bits") != 8
        or activations.get("type") != "int"
        or not activations.get("dynamic")
        or activations.get("strategy") != "token"
        or not activations.get("symmetric", True)
    ):
        raise ValueError(
            f"{where}.config_groups.{name}.input_activations must be symmetric 8-bit int quantized "
            "per 'token' at run time (dynamic), the W8A8 scheme the INT8 GEMM takes"
        )
    return QuantConfig(
        method="int8",
        checkpoint_format="compressed-tensors",
        weight_strategy=strategy,
        activation_scheme="dynamic",
        ignore=tuple(qc.get("ignore") or ()),
    )


def _vllm_fp8(qc: dict[str, Any], source: str) -> QuantConfig:
    if qc.get("weight_block_size") is not None:
        return _block_fp8(qc, source)
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ValueError(
            f"{source}: quantization_config.activation_scheme must be 'static' or 'dynamic', got {scheme!r}"
        )
    # vLLM's dynamic scheme for fp8 checkpoints quantizes activations per tensor; per token is at
    # least as accurate and is what our kernels take.
    return QuantConfig(
        method="fp8",
        checkpoint_format="fp8",
        weight_strategy="tensor",
        activation_scheme=scheme,
        ignore=tuple(qc.get("ignored_layers") or ()),
    )


def block_fp8_columns_supported(columns: object) -> bool:
    """Weight columns per block scale the block FP8 GEMM tiles (kernels/quant/block_fp8_matmul.py):
    one K step per block, a power of two from 16 to 256."""
    return (
        isinstance(columns, int)
        and not isinstance(columns, bool)
        and 16 <= columns <= 256
        and not columns & (columns - 1)
    )


def _block_fp8(qc: dict[str, Any], source: str) -> QuantConfig:
    where = f"{source}: quantization_config"
    block = qc["weight_block_size"]
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"{where}.weight_block_size must be two positive integers [rows, columns], got {block!r}")
    rows, columns = block
    if not block_fp8_columns_supported(columns):
        raise ValueError(
            f"{where}.weight_block_size columns must be a power of two from 16 to 256 (one GEMM step per "
            f"block), got {columns}"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt {fmt!r} is not supported (expected 'e4m3')")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"{where}.activation_scheme must be 'dynamic' for block-wise FP8 (activations quantized per "
            f"token and group of {columns} columns), got {scheme!r}"
        )
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in (None, "float"):
        raise ValueError(f"{where}.scale_fmt {scale_fmt!r} is not supported (expected float32 block scales)")
    keys = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    if not isinstance(keys, (list, tuple)) or not all(isinstance(key, str) for key in keys):
        raise ValueError(f"{where}.modules_to_not_convert must be a list of module names, got {keys!r}")
    return QuantConfig(
        method="fp8",
        checkpoint_format="fp8",
        weight_strategy="block",
        activation_scheme="dynamic",
        weight_block_size=(rows, columns),
        ignore=tuple(pattern for key in keys for pattern in transformers_skip_patterns(key)),
    )


def transformers_skip_patterns(key: str) -> tuple[str, str]:
    """A modules_to_not_convert entry as QuantConfig.ignore patterns, matching what transformers'
    quantizers skip: the key as a regex from the start of the name up to a module boundary
    ("model.layers.1" skips model.layers.1.mlp.down_proj, not model.layers.11...), or a plain suffix
    ("down_proj")."""
    return (rf"re:(?:{key})(?:(?<=\.)|(?=\.|$)).*", "re:.*" + re.escape(key))


def int4_group_size_supported(group_size: object) -> bool:
    """INT4 groups the kernels tile (kernels/int4_matmul.py): 8, 16, 32, ... input rows."""
    return (
        isinstance(group_size, int)
        and not isinstance(group_size, bool)
        and group_size >= 8
        and group_size & (group_size - 1) == 0
    )


def _int4(qc: dict[str, Any], method: str, source: str) -> QuantConfig:
    where = f"{source}: quantization_config"
    bits = qc.get("bits", qc.get("w_bit"))
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{where}.bits must be 4, got {bits!r}")
    if not int4_group_size_supported(group_size):
        raise ValueError(
            f"{where}.group_size must be a power of two of at least 8 (the INT4 kernels take one "
            f"group at a time), got {group_size!r}"
        )
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}.version {version!r} is not supported (expected 'gemm')")
        if not qc.get("zero_point", True):
            raise ValueError(f"{where}.zero_point false is not supported (AWQ's GEMM layout stores zero points)")
        zero_point = True
        ignore = tuple(qc.get("modules_to_not_convert") or ())
    else:
        if qc.get("desc_act"):
            raise ValueError(f"{where}.desc_act (act-order) is not supported")
        checkpoint_format = qc.get("checkpoint_format", "gptq")
        if checkpoint_format != "gptq":
            raise ValueError(f"{where}.checkpoint_format {checkpoint_format!r} is not supported (expected 'gptq')")
        zero_point = not qc.get("sym", True)
        ignore = ()
    return QuantConfig(
        method=method, checkpoint_format=method, bits=4, group_size=group_size, zero_point=zero_point, ignore=ignore
    )
