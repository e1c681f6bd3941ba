"""kv_cache_dtype="fp8": the engine keeps its KV cache in float8_e4m3fn (twice the blocks in the same
memory), with the checkpoint's per-layer scales where it has them, and decodes what the model-dtype
cache decodes, within FP8's rounding; the prefix cache and (on a GPU) the CUDA graphs run on it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.engine.config import EngineConfig
from gpuworker.engine.kv_cache_dtype import kv_cache_torch_dtype
from gpuworker.kernels.quant.kv_cache import FP8_DTYPE
from tests.gpuworker.checkpoints import TINY
from tests.gpuworker.engine.reference import random_prompts

LENGTHS = (1, 15, 16, 31, 47, 100, 250)
MAX_TOKENS = 10
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=96, max_model_len=272)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, TINY["vocab_size"], seed=5)


def first_token_logprobs(engine: LLMEngine, prompts: list[list[int]]) -> list[dict[int, float]]:
    return [dict(out.outputs[0].logprobs[0].top_logprobs) for out in engine.generate(prompts, FIRST_TOKEN)]


def assert_close_to_model_dtype_cache(fp8: LLMEngine, auto: LLMEngine, prompts: list[list[int]]) -> None:
    """The first token's top log-probabilities within FP8's rounding of the keys and values (the
    tiny model's logits span ~8 and drift up to ~0.04 for the likeliest token, ~0.35 for the fifth),
    and greedy decoding the same for the first tokens of every prompt and for most of them overall:
    a token whose top two logits lie closer than that rounding may flip, and the sequences part there."""
    for expected, got in zip(first_token_logprobs(auto, prompts), first_token_logprobs(fp8, prompts), strict=True):
        top = max(expected, key=expected.get)
        assert abs(expected[top] - got[top]) < 0.1
        shared = set(expected) & set(got)
        assert len(shared) >= 4
        assert max(abs(expected[token] - got[token]) for token in shared) < 0.5
    agreeing = []
    for a, b in zip(auto.generate(prompts, GREEDY), fp8.generate(prompts, GREEDY), strict=True):
        agreeing.append(next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), MAX_TOKENS))
    assert min(agreeing) >= 2 and sum(agreeing) >= 0.6 * MAX_TOKENS * len(prompts), agreeing


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'int8'"):
        EngineConfig(model="m", kv_cache_dtype="int8")


def test_auto_is_the_model_dtype_and_fp8_is_e4m3():
    assert kv_cache_torch_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16, "cpu") == FP8_DTYPE


def test_fp8_refused_on_a_gpu_older_than_ada(monkeypatch):
    # The device's answer is what lies outside the system: an A100 reports compute capability 8.0.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*has 8.0"):
        kv_cache_torch_dtype("fp8", torch.bfloat16, "cuda:0")


def test_fp8_cache_holds_twice_the_blocks_of_the_same_memory(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    budget = dict(device="cpu", dtype="bfloat16", kv_cache_memory_bytes=1 << 20, max_model_len=1024, max_num_seqs=256)
    auto, fp8 = LLMEngine(path, **budget), LLMEngine(path, kv_cache_dtype="fp8", **budget)
    assert fp8.runner.kv_cache.dtype == FP8_DTYPE and auto.runner.kv_cache.dtype == torch.bfloat16
    assert fp8.config.num_kv_blocks == 2 * auto.config.num_kv_blocks
    assert fp8.runner.kv_cache.nbytes == auto.runner.kv_cache.nbytes


def test_fp8_decodes_as_the_model_dtype_cache(tiny_checkpoint, prompts):
    path = tiny_checkpoint("llama")
    assert_close_to_model_dtype_cache(
        LLMEngine(path, kv_cache_dtype="fp8", **ENGINE), LLMEngine(path, **ENGINE), prompts
    )


def test_second_pass_reads_the_fp8_prefix_cache(tiny_checkpoint, prompts):
    # A prefix-cache hit reads the FP8 blocks the first pass wrote, as that pass's own prefill did.
    engine = LLMEngine(tiny_checkpoint("llama"), kv_cache_dtype="fp8", **ENGINE)
    first = engine.generate(prompts, GREEDY)
    second = engine.generate(prompts, GREEDY)
    assert [out.num_cached_tokens for out in second] == [(n - 1) // 16 * 16 for n in LENGTHS]
    assert [out.token_ids for out in second] == [out.token_ids for out in first]


def with_tensors(source: Path, destination: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of the checkpoint at `source` with `extra` tensors added to its safetensors file."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, destination)
    tensors = load_file(destination / "model.safetensors")
    save_file({**tensors, **extra}, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def test_checkpoint_kv_scales_are_used(tiny_checkpoint, prompts, tmp_path):
    # The tiny model's keys and values reach ~5: scales that put them far inside e4m3's range, as a
    # calibrated checkpoint's would. A layer's scales change what its cache holds, and the answers
    # still follow the model-dtype cache's (which ignores the scales).
    scales = {0: (0.03, 0.01), 1: (0.05, 0.02)}
    extra = {}
    for layer, (k_scale, v_scale) in scales.items():
        extra[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)  # a scalar, or one element
        extra[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v_scale])
    path = with_tensors(tiny_checkpoint("llama"), tmp_path / "llama-kv-scales", extra)

    fp8 = LLMEngine(path, kv_cache_dtype="fp8", **ENGINE)
    for layer, (k_scale, v_scale) in scales.items():
        attn = fp8.runner.model.layers[layer].self_attn
        assert (attn.k_scale, attn.v_scale) == pytest.approx((k_scale, v_scale))
    assert_close_to_model_dtype_cache(fp8, LLMEngine(path, **ENGINE), prompts)


def test_a_kv_scale_that_is_not_one_number_is_refused(tiny_checkpoint, tmp_path):
    path = with_tensors(
        tiny_checkpoint("llama"),
        tmp_path / "llama-per-head-scales",
        {"model.layers.1.self_attn.k_scale": torch.full((2,), 0.1)},
    )
    with pytest.raises(
        ValueError,
        match=r"model.layers.1.self_attn.k_scale in model.safetensors must hold one "
        r"scale .* got shape \(2,\)",
    ):
        LLMEngine(path, kv_cache_dtype="fp8", **ENGINE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_on_the_fp8_cache(tiny_checkpoint, prompts):
    # The Triton kernels with decode steps replayed from CUDA graphs, against the CPU's torch
    # backend on the same FP8 cache.
    path = tiny_checkpoint("llama")
    gpu = LLMEngine(path, **{**ENGINE, "device": "cuda"}, kv_cache_dtype="fp8")
    assert gpu.runner.decode_graphs is not None and gpu.runner.kv_cache.dtype == FP8_DTYPE
    assert_close_to_model_dtype_cache(gpu, LLMEngine(path, kv_cache_dtype="fp8", **ENGINE), prompts)
