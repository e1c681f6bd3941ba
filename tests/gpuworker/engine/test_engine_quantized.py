"""The engine serves quantized checkpoints: greedy tokens equal transformers' on the dequantised
float32 twin (with the format's FP8 activation rounding, where it has one), sync and async; FP8 at
load through EngineConfig.quantization."""

from __future__ import annotations

import pytest
import torch

from gpuworker.engine import LLMEngine, SamplingParams
from tests.gpuworker.engine.reference import greedy_generate, random_prompts
from tests.gpuworker.quantized_checkpoints import hf_reference, make_quantized_checkpoint

LENGTHS = (1, 16, 17, 40)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SCHEMES = (
    "fp8-ct-channel-weight-only",
    "fp8-ct-tensor-static",
    "fp8-vllm-dynamic",
    "fp8-block",
    "int8-ct-channel-dynamic",
    "awq",
    "gptq-asym",
)


@pytest.fixture(scope="module", params=SCHEMES)
def case(request, tmp_path_factory):
    quantized, twin = make_quantized_checkpoint(tmp_path_factory.mktemp("quantized"), request.param)
    prompts = random_prompts(LENGTHS, 384, seed=3)
    reference = greedy_generate(hf_reference(quantized, twin, request.param), prompts, MAX_TOKENS)
    return quantized, prompts, reference


@pytest.mark.parametrize(
    "device, async_scheduling",
    [
        ("cpu", False),
        ("cpu", True),
        # The Triton kernels (and CUDA graphs for decode) on the same float32 weights.
        pytest.param(
            "cuda",
            True,
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
    ids=["cpu-sync", "cpu-async", "cuda"],
)
def test_greedy_equals_the_dequantised_reference(case, device, async_scheduling):
    path, prompts, reference = case
    engine = LLMEngine(
        path, device=device, dtype="float32", num_kv_blocks=32, max_model_len=64, async_scheduling=async_scheduling
    )
    assert engine.model_config.quantization is not None
    outputs = engine.generate(prompts, GREEDY)
    assert [out.token_ids for out in outputs] == reference


def test_fp8_at_load(tmp_path):
    quantized, twin = make_quantized_checkpoint(tmp_path, "fp8-ct-channel-dynamic")
    prompts = random_prompts(LENGTHS, 384, seed=4)
    reference = greedy_generate(hf_reference(quantized, twin, "fp8-ct-channel-dynamic"), prompts, MAX_TOKENS)
    engine = LLMEngine(
        quantized.parent / "float" / "llama",
        device="cpu",
        dtype="float32",
        num_kv_blocks=32,
        max_model_len=64,
        quantization="fp8",
    )
    assert engine.model_config.quantization.checkpoint_format == "fp8-at-load"
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == reference


@pytest.mark.parametrize("quantization", ["int4", 8])
def test_bad_quantization_is_named(tiny_checkpoint, quantization):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLMEngine(tiny_checkpoint("llama"), device="cpu", quantization=quantization)
