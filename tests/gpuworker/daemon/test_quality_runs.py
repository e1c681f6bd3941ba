"""The daemon's quality measurements: the perplexity command in a process of its own, one at a
time, each reported running and then done (with the command's report) or failed (with why)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys

from gpuworker.contract.quality import DONE, FAILED, RUNNING
from gpuworker.contract.tasks import MeasureQuality
from gpuworker.daemon.quality_runs import QUALITY_NICENESS, QualityRuns, niced, quality_argv


def _runs(tmp_path_factory, gpu_count: int = 0):
    reports: queue.Queue = queue.Queue()
    runs = QualityRuns(
        model_roots=(tmp_path_factory.getbasetemp(),),
        gpu_count=gpu_count,
        report=lambda measurement_id, progress: reports.put((measurement_id, progress)),
    )
    return runs, reports


def test_the_command_gets_the_device_the_quantization_and_the_window(tmp_path):
    task = MeasureQuality(measurement_id=1, model_path="/m", gpu_index=2, quantization="fp8", window=64, max_tokens=128)
    command = [sys.executable, "-m", "gpuworker.quality", str(tmp_path)]
    options = ["--device", "cuda:2", "--quantization", "fp8", "--window", "64", "--max-tokens", "128"]
    assert quality_argv(task, tmp_path) == niced(command + options)
    plain = quality_argv(MeasureQuality(measurement_id=1, model_path="/m", gpu_index=None), tmp_path)
    assert plain == niced(command + ["--device", "cpu"])


def test_the_command_runs_at_a_higher_niceness_than_the_daemon():
    """On a CPU worker the measurement yields the CPU to the replicas serving tokens."""
    probe = subprocess.run(
        niced([sys.executable, "-c", "import os; print(os.nice(0))"]), capture_output=True, text=True, check=True
    )
    daemon = os.nice(0)
    assert int(probe.stdout) == min(19, daemon + QUALITY_NICENESS)  # 19: the lowest priority there is
    if daemon < 19:
        assert int(probe.stdout) > daemon


def test_measurements_run_one_at_a_time_and_a_repeated_message_runs_once(tmp_path_factory, tiny_checkpoint):
    runs, reports = _runs(tmp_path_factory)
    try:
        for measurement_id, quantization in ((1, ""), (2, "fp8"), (1, "")):
            runs.start(
                MeasureQuality(
                    measurement_id=measurement_id,
                    model_path=str(tiny_checkpoint("llama")),
                    gpu_index=None,
                    quantization=quantization,
                    window=16,
                    max_tokens=48,
                )
            )
        seen = [reports.get(timeout=120) for _ in range(4)]
        # The second starts only once the first has ended.
        assert [(m, p.state) for m, p in seen] == [(1, RUNNING), (1, DONE), (2, RUNNING), (2, DONE)]
        assert (seen[1][1].report.quantization, seen[3][1].report.quantization) == ("", "fp8")
        assert seen[1][1].report.window == 16 and seen[1][1].report.tokens == 48 - 48 // 16
        assert reports.empty()  # the repeated message ran nothing
    finally:
        runs.close()


def test_a_gpu_the_worker_lacks_is_refused_without_starting_anything(tmp_path_factory, tiny_checkpoint):
    runs, reports = _runs(tmp_path_factory, gpu_count=1)
    try:
        runs.start(MeasureQuality(measurement_id=5, model_path=str(tiny_checkpoint("llama")), gpu_index=1))
        measurement_id, progress = reports.get(timeout=30)
        assert (measurement_id, progress.state) == (5, FAILED)
        assert progress.error == "gpu_index 1 does not exist on this worker (it has 1 GPU(s))"
    finally:
        runs.close()
