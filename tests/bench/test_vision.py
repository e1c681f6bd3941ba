"""bench/vision.py end to end on the CPU (--smoke: the tests' tiny Qwen2.5-VL, small noise images):
the preprocessing rate, the engine's and HF's TTFT and throughput on the same requests, no GPU busy
share off CUDA, the least time and the JSON; bench/vision_bound.py's arithmetic against transformers'
parameter counts and against the 7B config's numbers worked out by hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"


def _smoke_run(out_dir, *options: str) -> subprocess.CompletedProcess:
    """bench/vision.py --smoke with `options`, its JSON under out_dir; it must succeed."""
    out = subprocess.run(
        [sys.executable, "bench/vision.py", "--smoke", *options],
        cwd=REPO,
        env={**os.environ, "OUT": str(out_dir), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_smoke_run_serves_images_through_the_engine_and_hf(tmp_path):
    out = _smoke_run(tmp_path, "--bound-gpu", H100)
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
    bound = result["least_time"]
    assert bound["gpu"] == H100 and (bound["tflops"], bound["tbps"]) == (989.0, 3.35)
    assert bound["decode_batch"] == 4  # the 4 requests, under the engine's max_num_seqs
    assert bound["least_time_s"] == pytest.approx(bound["vision_s"] + bound["prefill_s"] + bound["decode_s"], abs=2e-3)
    assert bound["engine_wall_over_least_time"] > 1 and bound["max_ratio_to_hf"] > 0
    assert f"== least time on {H100} ==" in out.stdout and "engine_wall_over_least_time" in out.stdout
    assert f"least time {bound['least_time_s']} s: the engine's {engine['wall_s']} s wall is " in out.stdout


@pytest.mark.slow
def test_the_profiled_smoke_run_says_where_the_time_went_by_phase(tmp_path):
    out = _smoke_run(tmp_path, "--profile", "--skip-hf", "--profile-kernels", "5")
    profile = json.loads((tmp_path / "vision.json").read_text())["profile"]
    assert profile["device"] == "cpu"
    phases = profile["phases"]
    # The engine's ranges: each phase ran some of the throughput run, and the phases and the gaps
    # outside them make up its wall.
    assert list(phases) == ["vision encoder", "prefill steps", "decode steps", "host gaps"]
    for name in ("vision encoder", "prefill steps", "decode steps"):
        assert phases[name]["s"] > 0 and phases[name]["share"] > 0, name
    total = sum(phase["s"] for phase in phases.values())
    assert total == pytest.approx(profile["wall_s"], abs=2e-3)
    assert len(profile["top_kernels"]) == 5 and all(k["name"].startswith("aten::") for k in profile["top_kernels"])
    assert "== where the throughput run's host time went (profiled) ==" in out.stdout
    assert "== top 5 ops by total time ==" in out.stdout
    for name in phases:
        assert f"\n{name}" in out.stdout and "% of wall" in out.stdout


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


@pytest.fixture(scope="module")
def bound(bench_script):
    return bench_script("vision_bound")


def tiny_qwen2_5_vl_config():
    import transformers

    from tests.gpuworker.checkpoints import TINY

    return transformers.Qwen2_5_VLConfig(
        text_config=dict(TINY),
        vision_config={
            "depth": 3,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 40,
            "out_hidden_size": 24,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
    )


def test_the_parameter_formulas_match_transformers_model(bound):
    import torch
    import transformers

    config = tiny_qwen2_5_vl_config()
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    params = dict(model.named_parameters())
    vision = sum(p.numel() for name, p in params.items() if ".visual." in name)
    assert bound.vision_params(config.vision_config.to_dict()) == vision
    # The LLM's matrices (embedding left out: a lookup, no FLOPs) are what each token multiplies through.
    text = bound.text_config(config.to_dict())
    matrices = sum(
        p.numel()
        for name, p in params.items()
        if ".visual." not in name and p.dim() == 2 and "embed_tokens" not in name
    )
    assert sum(bound.projection_params(text)) == matrices


def test_the_7b_configs_work_by_hand(bound, bench_script):
    common = bench_script("common")
    cfg = common.load_hf_config(REPO / "bench" / "configs" / "qwen2.5-vl-7b")
    vision = cfg["vision_config"]
    # Patch embedding 3 x 2 x 14 x 14 x 1280; 32 blocks of qkv and proj (4 x 1280^2) and the gated
    # MLP (3 x 1280 x 3420); the merger 5120 x 5120 + 5120 x 3584; norms and biases 505,600 + 9,984.
    assert bound.vision_matrices(vision) == (1_505_280 + 32 * 19_686_400, 44_564_480)
    assert bound.vision_params(vision) == 676_550_144
    # A 1024 px image: 74 x 74 patches, 37 x 37 merged tokens in windows of 4 x 4 merged tokens, the
    # last row and column of windows one merged token wide.
    windows = bound.window_lengths(vision, 74, 74)
    assert sorted(windows) == [4] + [16] * 18 + [64] * 81 and sum(windows) == 5476
    pairs = 28 * (81 * 64**2 + 18 * 16**2 + 4**2) + 4 * 5476**2  # windowed blocks, full blocks
    assert bound.vision_flops(vision, (1, 74, 74)) == (
        2 * 631_470_080 * 5476 + 2 * 44_564_480 * 1369 + 4 * 1280 * pairs
    )
    # The LLM: 28 layers of q/o (3584^2 each), k/v (3584 x 512 each), MLP (3 x 3584 x 18944), lm_head.
    text = bound.text_config(cfg)
    assert bound.projection_params(text) == (28 * 233_046_016, 3584 * 152_064)
    assert bound.prefill_flops(text, 1435) == (
        2 * 28 * 233_046_016 * 1435 + 2 * 3584 * 152_064 + 28 * 4 * 3584 * 1435 * 1436 // 2
    )


def test_one_decode_step_is_the_slower_of_its_flops_and_its_bytes(bound, bench_script):
    common = bench_script("common")
    text = bound.text_config(common.load_hf_config(REPO / "bench" / "configs" / "qwen2.5-vl-7b"))
    peak = common.gpu_peaks()[H100]
    weights = 2 * (28 * (233_046_016 + 2 * 3584) + 3584 + 3584 * 152_064)  # bf16, norms, lm_head
    kv = 28 * 2 * 4 * 128 * 2  # bytes a position
    # The second output token of 256 sequences of 1435 prompt tokens: 1436 positions each.
    flops = 256 * (2 * (28 * 233_046_016 + 3584 * 152_064) + 28 * 4 * 3584 * 1436)
    step = max(flops / 989e12, (weights + 256 * kv * 1436) / 3.35e12)
    assert bound.decode_s(text, 1435, 2, 256, 256, peak) == pytest.approx(step)
    # Two waves (256 then 1) take the full wave's step and a lone sequence's step.
    lone = max(flops / 256 / 989e12, (weights + kv * 1436) / 3.35e12)
    assert bound.decode_s(text, 1435, 2, 257, 256, peak) == pytest.approx(step + lone)


def test_a_gpu_without_peak_figures_is_named_and_skipped(bench_script, capsys):
    vision = bench_script("vision")
    row = vision.least_time_row(None, None, 0, {}, "none (cpu)")
    assert row == {
        "gpu": "none (cpu)",
        "skipped": "no dense bf16 peak or bandwidth for 'none (cpu)' in bench/configs/gpu_peaks.json",
    }
    vision.print_least_time(row, 1.0)
    assert capsys.readouterr().out == f"least time: skipped, {row['skipped']}\n"
