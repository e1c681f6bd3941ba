"""Tiny quantized checkpoints in the published layouts, each with its dequantised float32 twin.

    from tests.gpuworker.quantized_checkpoints import make_quantized_checkpoint, SCHEMES
    quantized, dequantised = make_quantized_checkpoint(tmp_path, "awq")

A tiny random float32 checkpoint (tests/gpuworker/checkpoints.py) has its decoder projections
quantized by the reference code below, written from the formats' documentation and independent of
gpuworker's readers: llm-compressor's compressed-tensors (float-quantized, and int-quantized W8A8 INT8),
vLLM's fp8 method, AutoAWQ's
GEMM layout, AutoGPTQ's layout, and DeepSeek's block-wise FP8 (weight and weight_scale_inv per
128 x 128 block, as transformers' FineGrainedFP8 reads it). The twin holds, in the plain Llama
layout, exactly the float32 weights the quantized ones stand for, so transformers run on it is the
reference for the engine run on the quantized files. Shapes are the smallest that hold a whole INT4 group of 128 inputs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.gpuworker.checkpoints import make_checkpoint

# Big enough that every projection has whole groups of 128 input rows.
QUANTIZABLE_SHAPE = {"hidden_size": 128, "intermediate_size": 256}
GROUP_SIZE = 128
FP8_MAX = 448.0
INT8_MAX = 127.0
_PROJECTION = re.compile(r"^(model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))\.weight$")
# Block FP8 also quantizes MoE experts and shared experts (routers stay dense).
_BLOCK_PROJECTION = re.compile(
    r"^(model\.layers\.\d+\.(self_attn\.(?:[qkvo]_proj|q_[ab]_proj|kv_b_proj|kv_a_proj_with_mqa)|mlp\.(experts\.\d+\.|shared_experts?\.)?(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123]))\.weight$"
)
# Block FP8 projections the engine widens to float at load, whose inputs it does not round: DeepSeek's
# kv_b_proj, which the absorbed latent attention splits per head (models.quantization.block_fp8).
DEQUANTISED_AT_LOAD = ("kv_b_proj",)
# AutoAWQ packs the eight columns of a word in this order: nibble i holds column ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# scheme -> quantization_config
SCHEMES: dict[str, dict[str, Any]] = {
    "fp8-ct-channel-weight-only": {"weights": "channel", "input_activations": None},
    "fp8-ct-channel-dynamic": {"weights": "channel", "input_activations": "token"},
    "fp8-ct-tensor-static": {"weights": "tensor", "input_activations": "tensor"},
    "int8-ct-channel-dynamic": {"type": "int", "weights": "channel", "input_activations": "token"},
    "int8-ct-tensor-dynamic": {"type": "int", "weights": "tensor", "input_activations": "token"},
    "fp8-vllm-static": {"quant_method": "fp8", "activation_scheme": "static"},
    "fp8-vllm-dynamic": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    # Blocks small enough that a tiny model's heads, MLP and experts split over two ranks in whole blocks.
    "fp8-block-16": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [16, 16],
    },
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm"},
    "gptq-sym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "sym": True, "desc_act": False},
    "gptq-asym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "sym": False, "desc_act": False},
}
# Schemes whose activations stay in the model dtype: the engine must match the float32 twin closely.
WEIGHT_ONLY = ("fp8-ct-channel-weight-only", "awq", "gptq-sym", "gptq-asym")


def make_quantized_checkpoint(
    tmp_path: str | Path, scheme: str, family: str = "llama", *, seed: int = 0, **overrides: Any
) -> tuple[Path, Path]:
    """(quantized checkpoint directory, dequantised float32 twin directory) under tmp_path."""

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    root = Path(tmp_path) / scheme
    source = make_checkpoint(root / "float", family, seed=seed, **{**QUANTIZABLE_SHAPE, **overrides})
    return quantize_checkpoint(source, root, scheme)


def quantize_checkpoint(source: Path, root: Path, scheme: str) -> tuple[Path, Path]:
    """(quantized, dequantised twin) directories under root of the float checkpoint `source`."""
    from safetensors.torch import load_file, save_file

    [weights_file] = source.glob("*.safetensors")
    tensors = load_file(str(weights_file))
    quantized: dict[str, torch.Tensor] = {}
    dequantised: dict[str, torch.Tensor] = {}
    projection = _BLOCK_PROJECTION if "weight_block_size" in SCHEMES[scheme] else _PROJECTION
    for index, (name, tensor) in enumerate(sorted(tensors.items())):
        match = projection.match(name)
        if match is None:
            quantized[name] = dequantised[name] = tensor
            continue
        packed, weight = _quantize(scheme, tensor.float(), index)
        quantized.update({f"{match.group(1)}.{field}": value for field, value in packed.items()})
        dequantised[name] = weight
    quantized_dir, twin_dir = root / "quantized", root / "dequantised"
    for directory, weights in ((quantized_dir, quantized), (twin_dir, dequantised)):
        shutil.copytree(source, directory)
        (directory / weights_file.name).unlink()
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            str(directory / weights_file.name),
            metadata={"format": "pt"},
        )
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (quantized_dir / "config.json").write_text(json.dumps(config, indent=2))
    return quantized_dir, twin_dir


def quantization_config(scheme: str) -> dict[str, Any]:
    spec = SCHEMES[scheme]
    if "quant_method" in spec:
        return dict(spec)
    activations, kind = spec["input_activations"], spec.get("type", "float")
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": spec["weights"], "dynamic": False},
    }
    group["input_activations"] = (
        None
        if activations is None
        else {
            "num_bits": 8,
            "type": kind,
            "symmetric": True,
            "strategy": activations,
            "dynamic": activations == "token",
        }
    )
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def _quantize(scheme: str, weight: torch.Tensor, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the checkpoint tensors of one projection, the float32 weight [out, in] they stand for)."""
    if scheme.startswith("fp8"):
        return _fp8(scheme, weight, index)
    if scheme.startswith("int8"):
        return _int8(scheme, weight)
    q, zeros, scales = _int4_groups(weight, symmetric=scheme == "gptq-sym", keep_zero_nonzero=scheme == "gptq-asym")
    groups = torch.arange(weight.shape[1]) // GROUP_SIZE
    dequantised = (q - zeros[:, groups]).float() * scales.float()[:, groups]
    # Both formats store [in, out]-major tensors.
    q_t, zeros_t, scales_t = q.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous()
    if scheme == "awq":
        packed = {"qweight": _pack_awq_columns(q_t), "qzeros": _pack_awq_columns(zeros_t), "scales": scales_t}
    else:
        packed = {
            "qweight": _pack_along_rows(q_t),
            "qzeros": _pack_along_rows((zeros_t - 1).t().contiguous()).t(),
            "scales": scales_t,
            "g_idx": groups.to(torch.int32),
        }
    return packed, dequantised


def _fp8(scheme: str, weight: torch.Tensor, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if "weight_block_size" in SCHEMES[scheme]:
        q, scale_inv = quantize_block_fp8(weight, SCHEMES[scheme]["weight_block_size"])
        return {"weight": q, "weight_scale_inv": scale_inv}, dequantize_block_fp8(
            q, scale_inv, SCHEMES[scheme]["weight_block_size"]
        )
    per_channel = SCHEMES[scheme].get("weights") == "channel"
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1, 1)
    scale = amax / FP8_MAX
    q = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    dequantised = q.float() * scale
    vllm = scheme.startswith("fp8-vllm")
    # compressed-tensors writes [out, 1] per channel and [1] per tensor; vLLM's fp8 writes scalars.
    packed = {"weight": q, "weight_scale": scale.reshape(()) if vllm else scale if per_channel else scale.reshape(1)}
    if scheme.endswith("static"):
        # Calibrated scales differ between fused projections (q, k, v): the engine must use the largest.
        input_scale = torch.tensor(6.0 / FP8_MAX * (1 + 0.1 * (index % 3)))
        packed["input_scale"] = input_scale if vllm else input_scale.reshape(1)
    return packed, dequantised


def _int8(scheme: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """llm-compressor's symmetric INT8 weights: round(weight / scale) in -128..127 with the largest
    magnitude of each channel (or of the tensor) mapped to 127; scales stored in bfloat16 as its
    W8A8 checkpoints store them, [out, 1] per channel and [1] per tensor."""
    per_channel = SCHEMES[scheme]["weights"] == "channel"
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1, 1)
    scale = (amax / INT8_MAX).bfloat16()
    q = torch.round(weight / scale.float()).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale if per_channel else scale.reshape(1)}, q.float() * scale.float()


def quantize_block_fp8(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [out, in] -> (float8_e4m3fn [out, in], float32 weight_scale_inv [ceil(out / rows),
    ceil(in / columns)]): each block's largest magnitude maps to FP8_MAX; the last blocks may be partial."""
    rows, cols = block
    out_features, in_features = weight.shape
    row_blocks, col_blocks = -(-out_features // rows), -(-in_features // cols)
    padded = torch.zeros(row_blocks * rows, col_blocks * cols)
    padded[:out_features, :in_features] = weight.float()
    blocks = padded.reshape(row_blocks, rows, col_blocks, cols)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:out_features, :in_features].contiguous(), scale_inv


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The float32 weight that block FP8 values and their weight_scale_inv stand for."""
    rows, cols = block
    per_element = scale_inv.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return q.float() * per_element[: q.shape[0], : q.shape[1]]


def _int4_groups(
    weight: torch.Tensor, *, symmetric: bool, keep_zero_nonzero: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per output row and group of GROUP_SIZE inputs: q [out, in] in 0..15, zeros and float16 scales
    [out, in / GROUP_SIZE], with weight ~= (q - zero) * scale."""
    out_features, in_features = weight.shape
    grouped = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    if symmetric:
        scales = (grouped.abs().amax(dim=-1) / 7.5).half()
        zeros = torch.full(scales.shape, 8, dtype=torch.int32)
    else:
        low, high = grouped.amin(dim=-1).clamp(max=0), grouped.amax(dim=-1).clamp(min=0)
        scales = ((high - low) / 15).half()
        zeros = torch.round(-low / scales.float()).to(torch.int32)
        if keep_zero_nonzero:
            # GPTQ stores zero - 1 in four bits: a zero of 0 would read back as 16 (the format's
            # overflow), so calibrators keep it at least 1.
            zeros = zeros.clamp(min=1)
    zeros = zeros.clamp(0, 15)
    q = torch.round(grouped / scales.float()[..., None]) + zeros[..., None]
    q = q.clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    return q, zeros, scales


def _pack_awq_columns(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C / 8]: word c's nibble i holds column 8c + AWQ_ORDER[i]."""
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i, column in enumerate(AWQ_ORDER):
            packed[:, c] |= (values[:, 8 * c + column].to(torch.int64) & 0xF) << (4 * i)
    return _as_int32(packed)


def _pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R / 8, C]: word i's nibble j holds row 8i + j (GPTQ's qweight)."""
    rows, cols = values.shape
    packed = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for j in range(8):
        packed |= (values[j::8].to(torch.int64) & 0xF) << (4 * j)
    return _as_int32(packed)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# Projections fused into one GEMM by the engine, which share one static input scale (the largest).
_FUSED_INPUTS = {
    "q_proj": ("q_proj", "k_proj", "v_proj"),
    "k_proj": ("q_proj", "k_proj", "v_proj"),
    "v_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_proj": ("gate_proj", "up_proj"),
    "up_proj": ("gate_proj", "up_proj"),
}


def hf_reference(quantized_dir: Path, twin_dir: Path, scheme: str, *, read_quantized: bool = True):
    """transformers' float32 model of the twin (of the quantized checkpoint itself for block FP8); for
    schemes that quantize activations, each projection first rounds its input through FP8 (INT8 for
    W8A8) as the format says (per token, per token and column group, or with the static scale)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # transformers reads block FP8 itself (FineGrainedFP8; on a CPU it dequantises at load, to the
    # float32 asked for) where every dimension is whole blocks or less than one (read_quantized); the
    # other layouts, and ragged blocks, run as their twins.
    source = quantized_dir if read_quantized and "weight_block_size" in SCHEMES[scheme] else twin_dir
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    activations = SCHEMES[scheme].get("input_activations", SCHEMES[scheme].get("activation_scheme"))
    if activations is None or scheme in WEIGHT_ONLY:
        return model
    tensors = load_file(str(next(quantized_dir.glob("*.safetensors"))))
    group = SCHEMES[scheme]["weight_block_size"][1] if "weight_block_size" in SCHEMES[scheme] else None
    if group is not None:
        for module in model.modules():
            if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):  # fused MoE experts
                module.forward = _block_fp8_experts_forward(module, group)
    for name, module in model.named_modules():
        match = re.fullmatch(
            r"(model\.layers\.\d+\.(?:self_attn|mlp(?:\.shared_experts?)?))\.(\w+_proj(?:_with_mqa)?)", name
        )
        if match is None or (group is not None and f"{name}.weight_scale_inv" not in tensors):
            continue  # not a projection, or one the block FP8 checkpoint leaves in float
        if match.group(2) in DEQUANTISED_AT_LOAD:
            continue
        static = None
        if scheme.endswith("static"):
            parent, proj = match.groups()
            static = max(
                float(tensors[f"{parent}.{p}.input_scale"].reshape(())) for p in _FUSED_INPUTS.get(proj, (proj,))
            )
        fake = _fake_int8 if scheme.startswith("int8") else lambda x, static=static: _fake_fp8(x, static, group)
        module.register_forward_pre_hook(lambda _, args, fake=fake: (fake(args[0]),))
    return model


def _block_fp8_experts_forward(experts, group: int):
    """transformers' routed experts loop (gate_up_proj [E, 2I, H], down_proj [E, H, I]) with each
    projection's input rounded through FP8 per token and group, as block FP8's MoE kernels do."""
    linear = torch.nn.functional.linear

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        x = _fake_fp8(hidden_states, None, group)
        for expert in range(experts.gate_up_proj.shape[0]):
            token, position = torch.where(top_k_index == expert)
            if token.numel() == 0:
                continue
            gate, up = linear(x[token], experts.gate_up_proj[expert]).chunk(2, dim=-1)
            hidden = _fake_fp8(experts.act_fn(gate) * up, None, group)
            down = linear(hidden, experts.down_proj[expert]) * top_k_weights[token, position, None]
            out.index_add_(0, token, down.to(out.dtype))
        return out

    return forward


def _fake_fp8(x: torch.Tensor, static: float | None, group: int | None = None) -> torch.Tensor:
    if group is not None:
        # Per token and group of `group` columns (block FP8's activations): each group a token of its own.
        k = x.shape[-1]
        padded = torch.nn.functional.pad(x, (0, -k % group))
        grouped = padded.reshape(*x.shape[:-1], -1, group)
        return _fake_fp8(grouped, None).reshape(padded.shape)[..., :k]
    scale = (
        torch.full((*x.shape[:-1], 1), static)
        if static is not None
        else x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    )
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def _fake_int8(x: torch.Tensor) -> torch.Tensor:
    """x rounded through symmetric INT8 per token: its largest magnitude maps to 127, and each value is
    x times the scale's reciprocal rounded half to even, as vLLM's per-token INT8 quantizer computes it.
    (x / scale, compressed-tensors' fake quantizer, differs where a quotient lies within a float32
    unit of a half: about one value in 10^5, enough to move a tiny model's greedy token.)"""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX
    return torch.round(x * (1.0 / scale)).clamp(-128, 127) * scale
