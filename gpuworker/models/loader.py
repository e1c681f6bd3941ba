"""Load a llama-style model and its tokenizer from a local checkpoint, never the network.

A checkpoint is a Hugging Face directory, whose weights come from safetensors shards
(model.safetensors.index.json or a single model.safetensors), or a GGUF file (or a directory holding
one), dequantised at load (gpuworker.models.gguf_checkpoint).
Every tensor's name and shape is checked against the model before any weight is read, so a wrong
checkpoint fails at once with the file and the expected shape in the message.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gpuworker.attention.backend import AttentionBackend
from gpuworker.attention.torch_backend import TorchAttentionBackend
from gpuworker.checkpoint_files import (
    WARM_FRACTION,
    TensorEntry,
    checkpoint_files,
    gguf_file,
    read_header,
    read_json,
    resident_fraction,
)
from gpuworker.checkpoint_quantization import LOAD_QUANTIZATIONS, fp8_at_load
from gpuworker.models.config import ModelConfig
from gpuworker.models.deepseek.model import DeepseekForCausalLM
from gpuworker.models.deepseek.rotary import DeepseekRotary
from gpuworker.models.gemma3.image_model import Gemma3ForConditionalGeneration
from gpuworker.models.gemma3.model import Gemma3ForCausalLM
from gpuworker.models.gguf_checkpoint import GGUFTensor, GGUFWeights, load_gguf_tokenizer, read_gguf_config
from gpuworker.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from gpuworker.models.llama import LlamaForCausalLM
from gpuworker.models.moe import SparseMoE
from gpuworker.models.parallel_context import Shard
from gpuworker.models.quantization.block_fp8_experts import BlockFp8Experts
from gpuworker.models.quantization.install import (
    install_quantized_linears,
    load_quantized_tensors,
    missing_quantized_tensors,
    quantized_shards,
)
from gpuworker.models.quantization.kv_scales import is_kv_scale, load_kv_scales
from gpuworker.models.quantization.linear import QuantizedLinear
from gpuworker.models.qwen2_5_vl.model import Qwen2_5_VLForConditionalGeneration
from gpuworker.models.tensor_parallel import ParallelContext, kv_head_range, vocab_range
from gpuworker.models.weight_stream import TORCH_DTYPES, TensorCopy, copy_tensors

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
LOAD_FORMATS = ("auto", "dummy")
# Checkpoint tensors the model has no use for and that are safe to skip.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
logger = logging.getLogger(__name__)
# Norms a family's decoder layer has beyond the input and post-attention ones (Gemma 3's).
_EXTRA_LAYER_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# The model is built deep inside LLMEngine; a caller that wants weight-loading progress (the worker
# server's /health) installs a callback for its own thread instead of threading it through every
# constructor. Context-local, so concurrent loads in other threads never see it.
# transformers' lazy module is not safe to import from two threads at once (a name can be missing
# in one while the other is importing it). The replica imports its server (xgrammar, which imports
# transformers) while the engine loads the tokenizer in another thread: both hold this lock.
TRANSFORMERS_IMPORT_LOCK = threading.Lock()
_progress_callback: ContextVar[Callable[[float], None] | None] = ContextVar("load_progress", default=None)


@contextmanager
def report_load_progress(callback: Callable[[float], None]) -> Iterator[None]:
    """Within the block, safetensors loads in this context call callback(fraction of weights copied)."""
    token = _progress_callback.set(callback)
    try:
        yield
    finally:
        _progress_callback.reset(token)


def load_progress_callback() -> Callable[[float], None] | None:
    """The callback report_load_progress set in this context, if any (to relay another process's
    load progress to it)."""
    return _progress_callback.get()


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse config.json (and generation_config.json, for extra EOS ids) in the directory `path`,
    or the metadata of the GGUF file `path` names."""
    file = gguf_file(path)
    if file is not None:
        with TRANSFORMERS_IMPORT_LOCK:
            config = read_gguf_config(file)
        return replace(ModelConfig.from_hf(config, source=str(file)), model_path=str(file))
    directory = _directory(path)
    config = read_json(directory / CONFIG_FILE, required=True)
    generation_config = read_json(directory / GENERATION_CONFIG_FILE, required=False)
    mc = ModelConfig.from_hf(config, generation_config, source=str(directory / CONFIG_FILE))
    return replace(mc, model_path=str(directory))


def load_model(
    config: ModelConfig | str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    attn_backend: AttentionBackend | None = None,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    parallel: ParallelContext | None = None,
) -> LlamaForCausalLM:
    """Build the decoder on `device` in `dtype` and fill it from the checkpoint's safetensors
    (with `parallel`: this rank's shard of it, see models.tensor_parallel).

    A quantized checkpoint (config.json's quantization_config) loads into quantized linears;
    quantization "fp8" quantizes a float checkpoint's projections to FP8 as they load.

    load_format "dummy" reads no weight file: parameters are drawn from normal(0, 0.02) (norm weights
    set to 1) directly on the device, for benchmarks of full-size shapes where values do not matter.
    """
    mc = with_quantization(config if isinstance(config, ModelConfig) else load_model_config(config), quantization)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    torch_dtype = resolve_dtype(dtype, mc)
    device = torch.device(device)
    if attn_backend is None:
        attn_backend = TorchAttentionBackend()
    # Built on the meta device and then allocated uninitialised in the target dtype: no float32
    # staging copy and no init kernels, which matters for 8B-parameter models.
    with torch.device("meta"):
        model = model_class(mc)(mc, attn_backend, parallel)
        if mc.quantization is not None:
            install_quantized_linears(model, mc.quantization)
    model = model.to(torch_dtype).to_empty(device=device)
    for module in model.modules():
        if isinstance(module, (RotaryEmbedding, DeepseekRotary)):
            module.reset_cache()
    if load_format == "dummy":
        _fill_dummy(model, seed)
    elif mc.model_path is not None and gguf_file(mc.model_path) is not None:
        _load_gguf(model, mc)
    else:
        _load_safetensors(model, mc)
    return model.eval()


def model_class(mc: ModelConfig) -> type[LlamaForCausalLM] | type[DeepseekForCausalLM]:
    """The decoder class of mc's family."""
    if mc.mla is not None:
        return DeepseekForCausalLM
    if mc.vision is not None:
        return Gemma3ForConditionalGeneration if mc.gemma3 is not None else Qwen2_5_VLForConditionalGeneration
    return Gemma3ForCausalLM if mc.gemma3 is not None else LlamaForCausalLM


def with_quantization(mc: ModelConfig, quantization: str | None) -> ModelConfig:
    """mc with the quantization asked for at load (None: the checkpoint's own, if any)."""
    if quantization not in LOAD_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {LOAD_QUANTIZATIONS}, got {quantization!r}")
    if quantization is None:
        return mc
    if mc.quantization is not None:
        raise ValueError(
            f"{mc.model_path}: the checkpoint is already quantized ({mc.quantization.label}); leave quantization unset"
        )
    return replace(mc, quantization=fp8_at_load())


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (a transformers fast tokenizer), with its chat template if any."""
    with TRANSFORMERS_IMPORT_LOCK:
        from transformers import AutoTokenizer

    file = gguf_file(path)
    if file is not None:
        with TRANSFORMERS_IMPORT_LOCK:
            return load_gguf_tokenizer(file)
    directory = _directory(path)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{directory}: no tokenizer found; expected one of {', '.join(TOKENIZER_FILES)}")
    try:
        with TRANSFORMERS_IMPORT_LOCK:  # from_pretrained imports the tokenizer's modules lazily
            return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory}: could not load the tokenizer: {exc}") from exc


def resolve_dtype(dtype: torch.dtype | str, mc: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = mc.torch_dtype if dtype == "auto" else dtype
    names = {
        "float32": torch.float32,
        "float": torch.float32,
        "float16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
    }
    if name not in names:
        raise ValueError(f"dtype must be one of {sorted(names)} or 'auto', got {dtype!r}")
    return names[name]


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor (or its `shard`) goes: rows [start, start + rows) of a model parameter."""

    param: torch.Tensor
    start: int
    rows: int
    shard: Shard | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape."""
        shape = [self.rows, *self.param.shape[1:]]
        if self.shard is not None:
            shape[self.shard.dim] = self.shard.size
        return tuple(shape)

    @property
    def dest(self) -> torch.Tensor:
        return self.param[self.start : self.start + self.rows]


def checkpoint_targets(model: LlamaForCausalLM) -> dict[str, _Target | None]:
    """HF tensor name -> slice of our (fused) parameters; None for a tensor that only other
    tensor-parallel ranks hold (another rank's experts)."""
    return _checkpoint_plan(model)[0]


def _checkpoint_plan(model: LlamaForCausalLM) -> tuple[dict[str, _Target | None], dict[str, Shard]]:
    """(checkpoint_targets, checkpoint module name -> this rank's shard of its weight for the
    modules with no dense weight: the quantized projections, which read their own tensors)."""
    mc = model.config
    targets: dict[str, _Target | None] = {}
    splits: dict[str, Shard] = {}
    parallel = model.parallel

    def add(
        name: str, param: torch.Tensor | None, start: int = 0, rows: int | None = None, shard: Shard | None = None
    ) -> None:
        if param is not None:
            rows = param.shape[0] if rows is None else rows
            targets[name] = _Target(param, start, rows, shard)
        elif shard is not None and name.endswith(".weight"):
            splits[name.removesuffix(".weight")] = shard

    def split(dim: int, size: int, length: int, begin: int | None = None) -> Shard | None:
        """This rank's `length` indices of `size` along dim (by default the rank's equal share)."""
        if parallel is None:
            return None
        return Shard(dim, parallel.rank * length if begin is None else begin, length, size)

    first_token, tokens, _ = (0, mc.vocab_size, 0) if parallel is None else vocab_range(mc.vocab_size, parallel)
    vocab = split(0, mc.vocab_size, tokens, first_token)
    add("model.embed_tokens.weight", model.embed_tokens, 0, tokens, vocab)
    add("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        add("lm_head.weight", model.lm_head, 0, tokens, vocab)
    if isinstance(model, DeepseekForCausalLM):
        _add_deepseek_layers(add, split, targets, model)
        return targets, splits
    if isinstance(model, Qwen2_5_VLForConditionalGeneration):  # the vision tower keeps HF's names
        for name, param in model.visual.named_parameters():
            add(f"visual.{name}", param)
    hd = mc.head_dim
    first_kv, num_kv = (0, mc.num_kv_heads) if parallel is None else kv_head_range(mc, parallel)
    for i, layer in enumerate(model.layers):
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"model.layers.{i}."
        q, kv = attn.q_size, attn.kv_size
        q_rows = split(0, mc.q_size, q)
        kv_rows = split(0, mc.kv_size, num_kv * hd, first_kv * hd)
        for kind in ("weight", "bias"):  # the biases of column-parallel projections split like their rows
            qkv = getattr(attn.qkv_proj, kind)
            add(f"{prefix}self_attn.q_proj.{kind}", qkv, 0, q, q_rows)
            add(f"{prefix}self_attn.k_proj.{kind}", qkv, q, kv, kv_rows)
            add(f"{prefix}self_attn.v_proj.{kind}", qkv, q + kv, kv, kv_rows)
            if isinstance(mlp, GatedMLP):
                _add_gated_mlp(add, split, f"{prefix}mlp.", mlp, kind, mc.intermediate_size)
        o_columns = None if q_rows is None else replace(q_rows, dim=1)
        add(f"{prefix}self_attn.o_proj.weight", attn.o_proj.weight, shard=o_columns)
        add(f"{prefix}self_attn.o_proj.bias", attn.o_proj.bias)
        if isinstance(mlp, SparseMoE):
            _add_moe(add, split, targets, prefix, mlp, mc.hidden_size)
        if attn.q_norm is not None:
            add(f"{prefix}self_attn.q_norm.weight", attn.q_norm.weight)
            add(f"{prefix}self_attn.k_norm.weight", attn.k_norm.weight)
        for norm in ("input_layernorm", "post_attention_layernorm", *_EXTRA_LAYER_NORMS):
            if hasattr(layer, norm):
                add(f"{prefix}{norm}.weight", getattr(layer, norm).weight)
    if isinstance(model, Gemma3ForConditionalGeneration):  # text under language_model., the rest as HF names it
        targets = {model.checkpoint_prefix + name: target for name, target in targets.items()}
        splits = {model.checkpoint_prefix + name: shard for name, shard in splits.items()}
        for module in ("vision_tower", "multi_modal_projector"):
            for name, param in getattr(model, module).named_parameters():
                add(f"{module}.{name}", param)
    return targets, splits


def _add_deepseek_layers(
    add: Callable[..., None],
    split: Callable[..., Shard | None],
    targets: dict[str, _Target | None],
    model: DeepseekForCausalLM,
) -> None:
    """DeepSeek's decoder layers: latent attention split by heads (q_proj or q_b_proj and kv_b_proj
    by rows, o_proj by columns; q_a_proj, kv_a_proj_with_mqa and the latent norms whole on every
    rank), then the dense MLP or the experts. Quantized projections load through their own modules."""
    mc = model.config
    mla = mc.mla
    for i, layer in enumerate(model.layers):
        prefix, attn = f"model.layers.{i}.", layer.self_attn
        heads = attn.num_heads

        def head_rows(width: int) -> Shard | None:
            return split(0, mc.num_heads * width, heads * width)

        per_head = {
            "q_proj": head_rows(mla.qk_head_dim),
            "q_b_proj": head_rows(mla.qk_head_dim),
            "kv_b_proj": head_rows(mla.qk_nope_head_dim + mla.v_head_dim),
            "o_proj": split(1, mc.num_heads * mla.v_head_dim, heads * mla.v_head_dim),
        }
        for module in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            linear = getattr(attn, module)
            if linear is None:
                continue
            weight = None if isinstance(linear, QuantizedLinear) else linear.weight
            add(f"{prefix}self_attn.{module}.weight", weight, shard=per_head.get(module))
            # Biases only on the whole (q_a, kv_a) and row-parallel (o) projections: never split.
            add(f"{prefix}self_attn.{module}.bias", linear.bias)
        for norm in ("q_a_layernorm", "kv_a_layernorm"):
            if getattr(attn, norm) is not None:
                add(f"{prefix}self_attn.{norm}.weight", getattr(attn, norm).weight)
        if isinstance(layer.mlp, SparseMoE):
            _add_moe(add, split, targets, prefix, layer.mlp, mc.hidden_size)
        else:
            for kind in ("weight", "bias"):
                _add_gated_mlp(add, split, f"{prefix}mlp.", layer.mlp, kind, mc.intermediate_size)
        add(f"{prefix}input_layernorm.weight", layer.input_layernorm.weight)
        add(f"{prefix}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)


def _add_gated_mlp(
    add: Callable[..., None], split: Callable[..., Shard | None], prefix: str, mlp: GatedMLP, kind: str, full_inter: int
) -> None:
    """gate and up: row ranges of gate_up_proj (this rank's rows of each); down: its columns."""
    inter, gate_up = mlp.intermediate_size, getattr(mlp.gate_up_proj, kind)
    rows = split(0, full_inter, inter)
    add(f"{prefix}gate_proj.{kind}", gate_up, 0, inter, rows)
    add(f"{prefix}up_proj.{kind}", gate_up, inter, inter, rows)
    columns = None if rows is None or kind == "bias" else replace(rows, dim=1)
    add(f"{prefix}down_proj.{kind}", getattr(mlp.down_proj, kind), shard=columns)


def _add_moe(
    add: Callable[..., None],
    split: Callable[..., Shard | None],
    targets: dict[str, _Target | None],
    prefix: str,
    moe: SparseMoE,
    hidden_size: int,
) -> None:
    """The router, this rank's experts' projections (row ranges of the stacked w13 and w2; other
    ranks' experts map to None) and the shared expert."""
    config = moe.config
    block, (gate, up, down) = f"{prefix}{config.checkpoint_prefix}.", config.expert_names
    inter = config.expert_intermediate_size
    add(f"{block}gate.weight", moe.gate.weight)
    add(f"{block}gate.e_score_correction_bias", moe.e_score_correction_bias)
    for e in range(config.num_experts):
        local = e - moe.first_expert
        names = (
            f"{block}experts.{e}.{gate}.weight",
            f"{block}experts.{e}.{up}.weight",
            f"{block}experts.{e}.{down}.weight",
        )
        if not 0 <= local < moe.num_local_experts:
            targets.update(dict.fromkeys(names))
            if moe.block_fp8_experts is not None:
                targets.update(dict.fromkeys(f"{name}_scale_inv" for name in names))
            continue
        experts = moe if moe.block_fp8_experts is None else moe.block_fp8_experts
        add(names[0], experts.w13, 2 * inter * local, inter)
        add(names[1], experts.w13, 2 * inter * local + inter, inter)
        add(names[2], experts.w2, hidden_size * local, hidden_size)
        if moe.block_fp8_experts is not None:
            _add_block_fp8_expert_scales(add, names, moe.block_fp8_experts, local)
    if moe.shared_expert is not None:
        shared = f"{block}{config.shared_expert_name}."
        _add_gated_mlp(add, split, shared, moe.shared_expert, "weight", config.shared_expert_intermediate_size)
    if moe.shared_expert_gate is not None:
        add(f"{block}shared_expert_gate.weight", moe.shared_expert_gate.weight)


def _add_block_fp8_expert_scales(
    add: Callable[..., None], names: tuple[str, str, str], experts: BlockFp8Experts, local: int
) -> None:
    """Block FP8 experts: each projection's weight_scale_inv, rows of the stacked scales."""
    inter_blocks, hidden_blocks = experts.inter_blocks, experts.hidden_blocks
    add(f"{names[0]}_scale_inv", experts.w13_scale, 2 * inter_blocks * local, inter_blocks)
    add(f"{names[1]}_scale_inv", experts.w13_scale, 2 * inter_blocks * local + inter_blocks, inter_blocks)
    add(f"{names[2]}_scale_inv", experts.w2_scale, hidden_blocks * local, hidden_blocks)


@torch.no_grad()
def _load_safetensors(model: LlamaForCausalLM, mc: ModelConfig) -> None:
    if mc.model_path is None:
        raise ValueError("ModelConfig.model_path is not set; build it with load_model_config(path)")
    targets, splits = _checkpoint_plan(model)
    shards = quantized_shards(model)
    quantized: list[tuple[Path, str]] = []
    kv_scales: list[tuple[Path, str]] = []
    files = checkpoint_files(Path(mc.model_path))
    # The headers first: names and shapes are checked before any weight is copied.
    plan: list[tuple[Path, list[TensorCopy]]] = []
    unexpected: list[str] = []
    found: set[str] = set()
    names: set[str] = set()
    for file in files:
        copies = []
        for entry in read_header(file):
            names.add(entry.name)
            if entry.name in targets:
                found.add(entry.name)
            target = targets.get(entry.name)
            module_name, _, field = entry.name.rpartition(".")
            if target is None and module_name in shards:
                module, shard = shards[module_name]
                module.check_field(shard, field)
                quantized.append((file, entry.name))
                continue
            if is_kv_scale(entry.name, mc.num_layers):
                kv_scales.append((file, entry.name))
                continue
            if target is None:
                if entry.name not in targets and not _skippable(entry.name, mc):
                    unexpected.append(f"{entry.name} (in {file.name})")
                continue
            if entry.shape != target.shape:
                raise ValueError(f"{entry.name} in {file.name} has shape {entry.shape}, expected {target.shape}")
            copies.append(_shard_copy(entry, target))
        plan.append((file, copies))
    _check_coverage(mc, targets, found, unexpected, ", ".join(f.name for f in files))
    _log_skipped_prediction_layers(mc, names)
    missing = missing_quantized_tensors(shards, {name for _, name in quantized})
    if missing:
        raise ValueError(
            f"{mc.model_path}: {len(missing)} quantized tensor(s) missing from "
            f"{', '.join(f.name for f in files)}: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
        )
    # Cached shards copy fastest in parallel; a cold disk reads fastest as one stream in file order.
    readers = None if resident_fraction(files) >= WARM_FRACTION else 1
    copy_tensors(plan, progress=_progress_callback.get(), num_readers=readers)
    if shards:
        load_quantized_tensors(shards, quantized, {name: s for name, s in splits.items() if name in shards})
    load_kv_scales(model.layers, kv_scales)


def _shard_copy(entry: TensorEntry, target: _Target) -> TensorCopy:
    """The copy of a target's part of a checkpoint tensor: a row shard is a contiguous byte range of
    the file, read alone; a column shard is read whole and its columns taken."""
    shard = target.shard
    if shard is None:
        return TensorCopy(entry, target.dest)
    if shard.dim == 1:
        return TensorCopy(entry, target.dest, columns=(shard.begin, shard.length))
    row_bytes = TORCH_DTYPES[entry.dtype].itemsize * math.prod(entry.shape[1:])
    begin = entry.begin + shard.begin * row_bytes
    rows = replace(entry, shape=(shard.length, *entry.shape[1:]), begin=begin, end=begin + shard.length * row_bytes)
    return TensorCopy(rows, target.dest)


@torch.no_grad()
def _load_gguf(model: LlamaForCausalLM, mc: ModelConfig) -> None:
    file = Path(mc.model_path)
    with TRANSFORMERS_IMPORT_LOCK:
        weights = GGUFWeights(file)
    targets = checkpoint_targets(model)
    # quantization "fp8" at load: the projections' dequantised weights go to their FP8 linears.
    shards = quantized_shards(model)
    quantized: list[GGUFTensor] = []
    # Names and shapes first, as for safetensors: checked before any block is dequantised.
    plan: list[tuple[GGUFTensor, torch.Tensor, Shard | None]] = []
    unexpected: list[str] = []
    found: set[str] = set()
    for tensor in weights.tensors():
        if tensor.name in targets:
            found.add(tensor.name)
        target = targets.get(tensor.name) if tensor.name is not None else None
        module_name, _, field = (tensor.name or "").rpartition(".")
        if target is None and module_name in shards:
            module, shard = shards[module_name]
            module.check_field(shard, field)
            quantized.append(tensor)
            continue
        if target is None:
            if tensor.name is not None and tensor.name not in targets and not _skippable(tensor.name, mc):
                unexpected.append(tensor.name)
            continue
        if tensor.shape != target.shape:
            raise ValueError(f"{tensor.name} in {file.name} has shape {tensor.shape}, expected {target.shape}")
        shard = target.shard
        plan.append((tensor, target.dest, shard))
    _check_coverage(mc, targets, found, unexpected, file.name)
    missing = missing_quantized_tensors(shards, {tensor.name for tensor in quantized})
    if missing:
        raise ValueError(
            f"{mc.model_path}: {len(missing)} tensor(s) missing from {file.name}: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    # One tensor dequantised at a time, straight into its parameter: the float32 copy is dropped
    # before the next, so a load holds the model and one tensor (not a second whole model).
    callback = _progress_callback.get()
    for done, (tensor, destination, shard) in enumerate(plan, 1):
        weight = weights.read(tensor)
        destination.copy_(weight if shard is None else weight.narrow(shard.dim, shard.begin, shard.length))
        if callback is not None:
            callback(done / len(plan))
    _quantize_gguf_projections(weights, shards, quantized)


def _quantize_gguf_projections(
    weights: GGUFWeights, shards: dict[str, tuple[QuantizedLinear, int]], tensors: list[GGUFTensor]
) -> None:
    """Hand each projection's dequantised weight to its quantized linear, which quantizes it as soon
    as all its shards (q, k and v; gate and up) are in: at most one fused projection in float32."""
    waiting = {id(module): len(module.checkpoint_names) for module, _ in shards.values()}
    for tensor in tensors:
        module_name, _, field = tensor.name.rpartition(".")
        module, shard = shards[module_name]
        module.load_shard(shard, field, weights.read(tensor))
        waiting[id(module)] -= 1
        if not waiting[id(module)]:
            module.finish()


def _skippable(name: str, mc: ModelConfig) -> bool:
    return (
        bool(_IGNORED.search(name))
        or (name == "lm_head.weight" and mc.tie_word_embeddings)
        or _prediction_layer(name, mc) is not None
    )


def _prediction_layer(name: str, mc: ModelConfig) -> int | None:
    """The index of the multi-token-prediction layer (GLM-4.5's, DeepSeek-V3's: the config's
    num_nextn_predict_layers layers after the last decoder layer) a tensor belongs to, else None.
    The engine does not run them."""
    match = _LAYER.match(name)
    extra_layers = mc.extra.get("num_nextn_predict_layers", 0)
    if match is None or not mc.num_layers <= int(match.group(1)) < mc.num_layers + extra_layers:
        return None
    return int(match.group(1))


def _log_skipped_prediction_layers(mc: ModelConfig, names: set[str]) -> None:
    layers = sorted({_prediction_layer(name, mc) for name in names} - {None})
    if layers:
        logger.info(
            "%s: skipping multi-token-prediction layer(s) %s (%d tensors): not run by this engine",
            mc.model_path,
            ", ".join(map(str, layers)),
            sum(_prediction_layer(name, mc) is not None for name in names),
        )


def _check_coverage(
    mc: ModelConfig, targets: dict[str, _Target | None], found: set[str], unexpected: list[str], files: str
) -> None:
    """Every parameter found in the checkpoint and no tensor left over, or a ValueError naming them."""
    missing = [name for name in targets if name not in found]
    if missing:
        raise ValueError(
            f"{mc.model_path}: {len(missing)} tensor(s) missing from "
            f"{files}: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
        )
    if unexpected:
        raise ValueError(
            f"{mc.model_path}: tensors not used by {mc.architecture}: "
            f"{', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else "")
        )


@torch.no_grad()
def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    generator = torch.Generator(device=model.embed_tokens.device).manual_seed(seed)
    # Each norm's identity scale: 1.0 for Llama's norm, 0.0 for Gemma's (x * (1 + weight)).
    norm_weights = {id(m.weight): getattr(m, "unit_weight", 1.0) for m in model.modules() if isinstance(m, RMSNorm)}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, BlockFp8Experts)):
            module.fill_dummy(generator)
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(norm_weights[id(param)])
        else:
            param.normal_(0.0, 0.02, generator=generator)


def _directory(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
    return directory
