"""bench/vision.py end to end on the CPU (--smoke: the tests' tiny Qwen2.5-VL, small noise images):
the preprocessing rate, the engine's and HF's TTFT and throughput on the same requests, no GPU busy
share off CUDA, and the JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_smoke_run_serves_images_through_the_engine_and_hf(tmp_path):
    out = subprocess.run(
        [sys.executable, "bench/vision.py", "--smoke"],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "vision.json").read_text())
    # 64 px noise resized to 56 x 56: 4 x 4 patches of 14 px, merged 2 x 2 into 4 tokens, between
    # the vision start and end tokens and before 8 question tokens.
    assert result["image_tokens"] == 4 and result["prompt_tokens"] == 2 + 4 + 8
    assert result["args"]["smoke"] is True and result["args"]["device"] == "cpu"
    assert result["preprocess_images_s_per_core"] > 0
    engine, hf = result["runs"]["engine"], result["runs"]["hf"]
    assert (engine["requests"], engine["output_tokens"]) == (4, 4 * 4)
    assert (hf["requests"], hf["output_tokens"]) == (2, 2 * 4)  # --hf-requests
    for row in (engine, hf):
        assert row["ttft_ms"] > 0 and row["throughput_tok_s"] > 0 and row["requests_s"] > 0
    assert engine["gpu_busy"] is None  # no GPU to sample
    assert "preprocessing: " in out.stdout and "images/s on one core (64 px, 4 tokens)" in out.stdout
    assert "== engine ==" in out.stdout and "== hf ==" in out.stdout
    assert "gpu_busy          None" in out.stdout
    assert "throughput vs HF: " in out.stdout


def test_the_busy_share_is_none_off_cuda(bench_script):
    vision = bench_script("vision")
    with vision.BusySampler("cpu") as sampler:
        pass
    assert sampler.samples == [] and sampler.busy is None


class _Recorded:
    """A PIL image that notes torch's intra-op threads each time the image processor converts it."""

    def __init__(self, image, threads: list[int]) -> None:
        self.image, self.threads = image, threads

    def convert(self, mode: str):
        import torch

        self.threads.append(torch.get_num_threads())
        return self.image.convert(mode)


def test_the_preprocessing_rate_is_one_cores_and_the_threads_come_back(bench_script, tmp_path):
    import torch

    from tests.gpuworker.models.vision_checkpoints import make_qwen2_5_vl

    vision = bench_script("vision")
    model = make_qwen2_5_vl(tmp_path)
    threads: list[int] = []
    images = [_Recorded(image, threads) for image in vision.noise_images(3, 64, seed=0)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert vision.preprocess_rate(str(model), images) > 0
        assert threads == [1] * 4 and torch.get_num_threads() == 2  # the warm-up and the 3 timed
    finally:
        torch.set_num_threads(before)
