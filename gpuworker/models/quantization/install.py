"""install_quantized_linears swaps the dense projections of a freshly built model (on the meta device)
for quantized ones (FP8, INT8 W8A8, INT4); the dense Linear path is untouched for unquantized
models. Embeddings, lm_head, norms and MoE routers stay dense; MoE experts are quantized for block FP8 checkpoints only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from gpuworker.checkpoint_quantization import QuantConfig
from gpuworker.models.layers import GatedMLP
from gpuworker.models.moe import SparseMoE
from gpuworker.models.parallel_context import Shard
from gpuworker.models.quantization.linear import QuantizedLinear
from gpuworker.models.tensor_parallel import RowParallelLinear


def install_quantized_linears(model: nn.Module, quant: QuantConfig) -> None:
    """Replace each decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj (DeepSeek's: its
    latent attention's projections) by its quantized twin, unless the checkpoint leaves those
    modules unquantized (quant.ignore); for block FP8, a sparse MoE layer's routed experts and
    shared expert too (its router stays dense). A split model's projections are already its rank's
    shapes; a row-parallel one's quantized twin joins the ranks as it did."""
    config = model.config
    if config.moe is not None and quant.weight_strategy != "block":
        raise ValueError(f"{config.model_path}: quantized mixture-of-experts checkpoints are not supported yet")
    if config.mla is not None:
        _install_latent_attention(model, quant)
        return
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.q_size, attn.kv_size  # this rank's rows of each
        attn.qkv_proj = _quantized(
            attn.qkv_proj, quant, (q, kv, kv), tuple(f"{prefix}self_attn.{n}_proj" for n in "qkv")
        )
        attn.o_proj = _quantized(attn.o_proj, quant, (config.hidden_size,), (f"{prefix}self_attn.o_proj",))
        if isinstance(mlp, GatedMLP):
            _quantize_gated_mlp(mlp, quant, f"{prefix}mlp.", ("gate_proj", "up_proj", "down_proj"))
        elif isinstance(mlp, SparseMoE):
            _block_fp8_moe(mlp, quant, prefix)


def _install_latent_attention(model: nn.Module, quant: QuantConfig) -> None:
    """DeepSeek's layers (block FP8 checkpoints): every attention projection in BlockFp8Linear but
    kv_b_proj, dequantised at load (DequantizedBlockFp8Linear says why); the MLPs as the llama path's."""
    from gpuworker.models.quantization.block_fp8 import DequantizedBlockFp8Linear

    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for module in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            linear = getattr(attn, module)
            if linear is not None:
                name = f"{prefix}self_attn.{module}"
                setattr(attn, module, _quantized(linear, quant, (linear.weight.shape[0],), (name,)))
        name = f"{prefix}self_attn.kv_b_proj"
        if not quant.ignores(name):
            out_features, in_features = attn.kv_b_proj.weight.shape
            attn.kv_b_proj = DequantizedBlockFp8Linear(
                in_features, out_features, False, quant, (name,), (out_features,)
            )
        if isinstance(mlp, GatedMLP):
            _quantize_gated_mlp(mlp, quant, f"{prefix}mlp.", ("gate_proj", "up_proj", "down_proj"))
        elif isinstance(mlp, SparseMoE):
            _block_fp8_moe(mlp, quant, prefix)


def _quantize_gated_mlp(mlp: GatedMLP, quant: QuantConfig, prefix: str, names: tuple[str, str, str]) -> None:
    inter, (gate, up, down) = mlp.intermediate_size, names
    mlp.gate_up_proj = _quantized(mlp.gate_up_proj, quant, (inter, inter), (f"{prefix}{gate}", f"{prefix}{up}"))
    mlp.down_proj = _quantized(mlp.down_proj, quant, (mlp.down_proj.weight.shape[0],), (f"{prefix}{down}",))


def _block_fp8_moe(moe: SparseMoE, quant: QuantConfig, prefix: str) -> None:
    """A block FP8 checkpoint's MoE layer: its routed experts in BlockFp8Experts (all quantized, or all
    left dense by modules_to_not_convert), its shared expert quantized as a dense MLP."""
    from gpuworker.models.quantization.block_fp8_experts import BlockFp8Experts

    config = moe.config
    block = f"{prefix}{config.checkpoint_prefix}."
    if moe.shared_expert is not None:
        _quantize_gated_mlp(
            moe.shared_expert, quant, f"{block}{config.shared_expert_name}.", ("gate_proj", "up_proj", "down_proj")
        )
    experts = [f"{block}experts.{e}.{name}" for e in range(config.num_experts) for name in config.expert_names]
    ignored = [quant.ignores(name) for name in experts]
    if all(ignored):
        return
    if any(ignored):
        raise ValueError(f"{block}experts: modules_to_not_convert leaves only some experts' projections unquantized")
    inter = config.expert_intermediate_size
    moe.block_fp8_experts = BlockFp8Experts(moe.num_local_experts, moe.hidden_size, inter, quant.weight_block_size)
    moe.w13 = moe.w2 = None


def quantized_shards(model: nn.Module) -> dict[str, tuple[QuantizedLinear, int]]:
    """Checkpoint module name (model.layers.0.self_attn.k_proj) -> (its quantized linear, shard index)."""
    return {
        name: (module, shard)
        for module in model.modules()
        if isinstance(module, QuantizedLinear)
        for shard, name in enumerate(module.checkpoint_names)
    }


def missing_quantized_tensors(shards: dict[str, tuple[QuantizedLinear, int]], found: set[str]) -> list[str]:
    """The tensors the quantized linears need that are not in `found` (checkpoint tensor names)."""
    modules = {id(m): m for m, _ in shards.values()}.values()
    return [name for module in modules for name in module.required_names() if name not in found]


def load_quantized_tensors(
    shards: dict[str, tuple[QuantizedLinear, int]], entries: list[tuple[Path, str]], splits: dict[str, Shard]
) -> None:
    """Hand each quantized tensor (file, name) to its linear, then let every linear build its kernel
    layout. `splits`: checkpoint module name -> this rank's shard of its weight (absent: all of it),
    set as the linear's checkpoint_shards; only that part of each tensor is read.

    Read with safetensors' own reader rather than the loader's byte streaming: these tensors are
    converted (unpacked, fused, quantized) on their way in, not copied as they are.
    """
    from safetensors import safe_open

    for module_name, split in splits.items():
        module, shard = shards[module_name]
        module.checkpoint_shards[shard] = split
    by_file: dict[Path, list[str]] = {}
    for file, name in entries:
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as reader:
            for name in names:
                module_name, _, field = name.rpartition(".")
                module, shard = shards[module_name]
                module.load_shard(shard, field, _read_shard(reader, name, module, shard, field))
    for module in {id(m): m for m, _ in shards.values()}.values():
        module.finish()


def _read_shard(reader, name: str, module: QuantizedLinear, shard: int, field: str) -> torch.Tensor:
    """Tensor `name`, or the part of it this rank's shard of the module takes (read alone)."""
    weight_shard = module.checkpoint_shards[shard]
    if weight_shard is None:
        return reader.get_tensor(name)
    tensor = reader.get_slice(name)
    shape = tuple(tensor.get_shape())
    part = module.field_shard(field, weight_shard, shape)
    if part is None:
        return reader.get_tensor(name)
    if len(shape) <= part.dim or shape[part.dim] != part.size:
        raise ValueError(f"{name} has shape {tuple(shape)}, expected {part.size} along dimension {part.dim}")
    end = part.begin + part.length
    return tensor[part.begin : end] if part.dim == 0 else tensor[:, part.begin : end]


def _quantized(
    linear: nn.Module, quant: QuantConfig, shard_sizes: tuple[int, ...], names: tuple[str, ...]
) -> nn.Module:
    ignored = [quant.ignores(name) for name in names]
    if all(ignored):
        return linear
    if any(ignored):
        raise ValueError(f"{', '.join(names)} are fused into one projection but only some are quantized")
    # Imported when a quantized model is built: they import Triton, which float models on CPU never need.
    from gpuworker.models.quantization.block_fp8 import BlockFp8Linear
    from gpuworker.models.quantization.fp8 import Fp8Linear
    from gpuworker.models.quantization.int4 import Int4Linear
    from gpuworker.models.quantization.int8 import Int8Linear

    if quant.weight_strategy == "block":
        cls = BlockFp8Linear
    else:
        cls = {"fp8": Fp8Linear, "int8": Int8Linear}.get(quant.method, Int4Linear)
    out_features, in_features = linear.weight.shape
    quantized = cls(in_features, out_features, linear.bias is not None, quant, names, shard_sizes)
    if isinstance(linear, RowParallelLinear):
        quantized.row_parallel = linear.parallel
    return quantized
