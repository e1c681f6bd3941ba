"""The hardware probe: psutil figures always; NVML figures where a GPU is present (run on the GPU host too)."""

from __future__ import annotations

import pytest

from gpuworker.daemon.hardware import HardwareError, HardwareProbe


def _has_gpu() -> bool:
    try:
        probe = HardwareProbe("auto")
    except HardwareError:
        return False
    try:
        return probe.gpu_count > 0
    finally:
        probe.close()


def test_cpu_probe_reports_ram_cores_and_load():
    probe = HardwareProbe("cpu")
    inventory, sample = probe.inventory(), probe.sample()
    assert probe.device == "cpu" and inventory["gpus"] == [] and sample["gpus"] == []
    assert inventory["cpu"]["cores"] >= 1 and inventory["cpu"]["memory_total_bytes"] > 2**20
    cpu = sample["cpu"]
    assert set(cpu) == {"utilization_pct", "memory_used_bytes", "memory_total_bytes"}
    assert 0 <= cpu["utilization_pct"] <= 100 and 0 < cpu["memory_used_bytes"] < cpu["memory_total_bytes"]


def test_device_choice_is_checked():
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        HardwareProbe("tpu")


@pytest.mark.skipif(_has_gpu(), reason="this host has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(HardwareError, match="--device cuda, but NVML"):
        HardwareProbe("cuda")
    assert HardwareProbe("auto").device == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="no GPU visible to NVML")
def test_gpu_probe_reports_nvml_figures():
    probe = HardwareProbe("auto")
    try:
        inventory, sample = probe.inventory(), probe.sample()
        assert probe.device == "cuda" and len(inventory["gpus"]) == probe.gpu_count == len(sample["gpus"])
        first = inventory["gpus"][0]
        assert first["index"] == 0 and first["name"] and first["memory_total_bytes"] > 2**30
        figures = sample["gpus"][0]
        assert set(figures) == {
            "index",
            "utilization_pct",
            "memory_used_bytes",
            "memory_total_bytes",
            "temperature_c",
            "power_w",
        }
        assert figures["memory_total_bytes"] == first["memory_total_bytes"]
        assert 0 <= figures["utilization_pct"] <= 100 and figures["temperature_c"] > 0 and figures["power_w"] > 0
    finally:
        probe.close()
