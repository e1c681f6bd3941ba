"""A replica serves quantized checkpoints (FP8, AWQ) and FP8 at load through its OpenAI API, with
the tokens the engine gives on its own."""

from __future__ import annotations

import httpx
import pytest

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.replica.app import ServerConfig
from tests.gpuworker.quantized_checkpoints import make_quantized_checkpoint
from tests.gpuworker.replica.test_app import TOKEN, _serving


@pytest.mark.parametrize(
    "scheme, quantization", [("awq", None), ("fp8-vllm-static", None), ("fp8-ct-channel-dynamic", "fp8")]
)
def test_completion_from_a_quantized_replica(tmp_path, scheme, quantization):
    quantized, _ = make_quantized_checkpoint(tmp_path, scheme)
    model = quantized if quantization is None else quantized.parent / "float" / "llama"
    prompt = [5, 17, 33, 2, 99]
    engine = LLMEngine(
        model, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64, quantization=quantization
    )
    [expected] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    config = ServerConfig(
        model=str(model), served_model_name="tiny-q", token=TOKEN, max_model_len=64, quantization=quantization
    )
    with _serving(config) as (base, _):
        response = httpx.post(
            f"{base}/v1/completions",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
            json={"model": "tiny-q", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == expected.text
