"""Block-wise FP8 checkpoints (DeepSeek-V3/R1's and Kimi K2's format) split over tensor-parallel ranks on
CPU with gloo: TP=2 through LLMEngine equals TP=1 token for token (a DeepSeek-V3-shaped model: latent
attention, a dense first layer, routed and shared experts; with the experts joined by all-reduce or
dispatched all-to-all), each rank holds and reads exactly its rows or columns of every weight and of
its block scales, and a shard that would cut a scale block is refused. FP8 with a scale per output
channel splits as well; INT4 (AWQ, GPTQ) is refused with the reason."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from safetensors.torch import load_file

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.kernels.quant.fp8_matmul import FP8_DTYPE
from gpuworker.models.loader import load_model, load_model_config
from gpuworker.models.quantization.block_fp8 import BlockFp8Linear, DequantizedBlockFp8Linear
from gpuworker.models.quantization.fp8 import Fp8Linear
from gpuworker.models.tensor_parallel import ParallelContext, shard_config
from tests.gpuworker.models.deepseek_checkpoints import make_mla_checkpoint
from tests.gpuworker.quantized_checkpoints import make_quantized_checkpoint, quantize_checkpoint

# 16 x 16 blocks: the tiny model's heads, dense MLP and shared expert split over two ranks in whole blocks.
SCHEME = "fp8-block-16"
PROMPTS = [[1, 5, 9, 200, 17], list(range(3, 60)), [7] * 20, [11, 300, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """A block FP8 DeepSeek-V3-shaped checkpoint: q_lora_rank, layer 0 dense, layer 1 16 routed
    experts (grouped sigmoid routing) and a shared expert."""
    root = tmp_path_factory.mktemp("v3")
    quantized, _ = quantize_checkpoint(make_mla_checkpoint(root / "float", "deepseek-v3-moe"), root, SCHEME)
    return quantized


def _generate(engine: LLMEngine) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", ["all_reduce", "all_to_all"])
def test_deepseek_tp2_matches_tp1(v3, expert_parallel):
    expected = _generate(LLMEngine(v3, max_num_batched_tokens=32))
    assert len({token for tokens in expected for token in tokens}) > 4  # not a constant output
    engine = LLMEngine(v3, tensor_parallel_size=2, expert_parallel=expert_parallel, max_num_batched_tokens=32)
    try:
        model = engine.runner.model
        attn, moe = model.layers[0].self_attn, model.layers[1].mlp
        assert isinstance(attn.o_proj, BlockFp8Linear) and attn.o_proj.row_parallel is model.parallel
        assert moe.block_fp8_experts.num_experts * 2 == moe.config.num_experts
        assert moe.parallel.dispatch_experts == (expert_parallel == "all_to_all")
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2-moe"])
def test_llama_style_tp2_matches_tp1(tmp_path, family):
    # Fused q, k, v and gate, up rows per rank; qwen2-moe: block FP8 experts, a gated shared expert.
    quantized, _ = make_quantized_checkpoint(tmp_path, SCHEME, family)
    expected = _generate(LLMEngine(quantized, max_num_batched_tokens=32))
    engine = LLMEngine(quantized, tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj, BlockFp8Linear)
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


def _quantized_tensors(module) -> dict[str, torch.Tensor]:
    return {name: t for name, t in module.named_buffers() if t.dtype == FP8_DTYPE or "scale" in name}


def test_each_rank_holds_exactly_its_shard(v3):
    """Rows of the column-parallel projections (q_b_proj, kv_b_proj, gate_up_proj) and of their block
    scales, columns of the row-parallel ones (o_proj, down_proj) and of theirs, whole experts with
    their scales, and the latent projections whole on every rank: the two ranks' shards put together
    are the unsplit model's, and a split tensor's bytes are halved on each rank."""
    mc = load_model_config(v3)
    whole = load_model(mc)
    ranks = [load_model(mc, parallel=ParallelContext(rank, 2)) for rank in range(2)]
    column_parallel = ("q_b_proj", "kv_b_proj", "gate_up_proj", "block_fp8_experts")
    row_parallel = ("o_proj", "down_proj")
    tensors = {**_quantized_tensors(whole), **{n: t for n, t in whole.named_buffers() if "kv_b_proj" in n}}
    checked = set()
    for name, full in tensors.items():
        parts = [dict(rank.named_buffers())[name] for rank in ranks]
        module = name.split(".")[-2]
        if module in column_parallel:
            dim = 0
        elif module in row_parallel:
            dim = 1
        else:  # q_a_proj, kv_a_proj_with_mqa: the latent is per token, whole on every rank
            assert all(torch.equal(part.float(), full.float()) for part in parts), name
            continue
        if module == "gate_up_proj":  # each rank's gate rows then its up rows
            halves = [part.chunk(2) for part in parts]
            joined = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            joined = torch.cat(parts, dim=dim)
        assert torch.equal(joined.float(), full.float()), name
        assert all(part.nbytes * 2 == full.nbytes for part in parts), name
        checked.add(module)
    assert checked == {"q_b_proj", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj", "block_fp8_experts"}
    stored = load_file(str(next(v3.glob("*.safetensors"))))
    name = "model.layers.1.self_attn.o_proj"
    o_proj = ranks[1].layers[1].self_attn.o_proj
    assert torch.equal(o_proj.weight_scale_inv, stored[f"{name}.weight_scale_inv"][:, 3:])  # columns 48..95
    assert isinstance(ranks[0].layers[0].self_attn.kv_b_proj, DequantizedBlockFp8Linear)


def test_each_rank_reads_only_its_part_of_a_quantized_tensor(v3, monkeypatch):
    """A rank reads its slice of each split projection's weight and scales from the file, not the
    whole tensor (its experts and replicated projections are read whole)."""
    from safetensors import safe_open

    read_whole: list[str] = []
    original = safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.reader = original(*args, **kwargs)

        def __enter__(self):
            self.reader.__enter__()
            return self

        def __exit__(self, *exc):
            return self.reader.__exit__(*exc)

        def get_tensor(self, name):
            read_whole.append(name)
            return self.reader.get_tensor(name)

        def get_slice(self, name):
            return self.reader.get_slice(name)

    monkeypatch.setattr("safetensors.safe_open", Recording)
    load_model(v3, parallel=ParallelContext(1, 2))
    assert read_whole  # the whole-on-every-rank projections
    split = ("q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert not [name for name in read_whole if name.rsplit(".", 2)[-2] in split]


def test_an_intermediate_size_that_cuts_a_block_is_refused(tmp_path):
    # 16 x 16 blocks, intermediate_size 80: 40 rows per rank, two and a half blocks.
    quantized, _ = make_quantized_checkpoint(tmp_path, SCHEME, intermediate_size=80)
    with pytest.raises(ValueError, match=r"intermediate_size \(80\) .* gives 40 per rank, .*\[16, 16\]"):
        shard_config(load_model_config(quantized), ParallelContext(0, 2))


@pytest.mark.parametrize("scheme", ["awq", "gptq-sym"])
def test_int4_models_are_refused_with_the_reason(tmp_path, scheme):
    mc = load_model_config(make_quantized_checkpoint(tmp_path, scheme)[0])
    with pytest.raises(
        ValueError,
        match=r"quantization: a .*-int4 model \(.*\) cannot be split over tensor_parallel_size \(2\) ranks: "
        r"its INT4 weights are packed and scaled per group of input columns",
    ):
        shard_config(mc, ParallelContext(0, 2))
    assert shard_config(mc, ParallelContext(0, 1)) is mc  # one rank: nothing to split


# FP8 with a scale per output channel (compressed-tensors, vLLM's fp8) splits too: a rank's rows take
# their channels' scales, its columns every channel's.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("scheme", "family"),
    [
        ("fp8-ct-channel-weight-only", "llama"),
        # A static per-tensor input scale, and biases: the row-parallel o_proj adds its bias once.
        ("fp8-ct-tensor-static", "llama-bias"),
    ],
)
def test_per_channel_fp8_tp2_matches_tp1(tmp_path, scheme, family):
    # Dynamic activations are quantized per token over each rank's own input columns in the
    # row-parallel projections (as vLLM does), so only these schemes give TP=1's tokens exactly.
    quantized, _ = make_quantized_checkpoint(tmp_path, scheme, family)
    expected = _generate(LLMEngine(quantized, max_num_batched_tokens=32))
    engine = LLMEngine(quantized, tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        o_proj = engine.runner.model.layers[0].self_attn.o_proj
        assert isinstance(o_proj, Fp8Linear) and o_proj.row_parallel is not None
        assert _generate(engine) == expected
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


def test_a_per_channel_fp8_rank_holds_its_channels_scales(tmp_path):
    quantized, _ = make_quantized_checkpoint(tmp_path, "fp8-ct-channel-dynamic")
    mc = load_model_config(quantized)
    whole = load_model(mc).layers[0]
    ranks = [load_model(mc, parallel=ParallelContext(rank, 2)).layers[0] for rank in range(2)]
    for module, dim in (("mlp.gate_up_proj", 0), ("mlp.down_proj", 1), ("self_attn.o_proj", 1)):
        full, parts = whole.get_submodule(module), [rank.get_submodule(module) for rank in ranks]
        if module == "mlp.gate_up_proj":  # each rank's gate rows then its up rows, with their scales
            for name in ("weight_fp8", "weight_scale"):
                halves = [getattr(part, name).chunk(2) for part in parts]
                joined = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
                assert torch.equal(joined.float(), getattr(full, name).float())
        else:  # row-parallel: its input columns, every output channel's scale
            joined = torch.cat([part.weight_fp8 for part in parts], dim=dim)
            assert torch.equal(joined.float(), full.weight_fp8.float())
            assert all(torch.equal(part.weight_scale, full.weight_scale) for part in parts)
        assert all(part.weight_fp8.nbytes * 2 == full.weight_fp8.nbytes for part in parts)
