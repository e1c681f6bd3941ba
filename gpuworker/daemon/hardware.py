"""What the host has and how busy it is: GPUs through NVML (nvidia-ml-py), CPU and RAM through psutil.

probe = HardwareProbe("auto")      # "cuda" if NVML finds a GPU, else "cpu"
probe.inventory()                  # for registration: GPU names and memory, RAM and cores
probe.sample()                     # for heartbeats: utilisation, memory, temperature, power
"""

from __future__ import annotations

import logging
from typing import Any

import psutil

logger = logging.getLogger(__name__)


class HardwareError(RuntimeError):
    pass


class HardwareProbe:
    def __init__(self, device: str = "auto") -> None:
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
        self._nvml = None
        self._handles: list[Any] = []
        if device != "cpu":
            self._handles = self._open_nvml(required=device == "cuda")
        self.device = "cuda" if self._handles else "cpu"
        psutil.cpu_percent(interval=None)  # the first reading only starts the measurement

    def _open_nvml(self, required: bool) -> list[Any]:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # no driver, no library, no device: all mean "no GPU here"
            if required:
                raise HardwareError(f"--device cuda, but NVML found no usable GPU: {exc}") from exc
            logger.info("no GPU found through NVML (%s); running on CPU", exc)
            return []
        if not handles and required:
            raise HardwareError("--device cuda, but NVML reports no GPU")
        self._nvml = pynvml
        return handles

    @property
    def gpu_count(self) -> int:
        return len(self._handles)

    def inventory(self) -> dict[str, Any]:
        """{"gpus": [{index, name, memory_total_bytes}], "cpu": {memory_total_bytes, cores}}."""
        gpus = []
        for index, handle in enumerate(self._handles):
            name = self._nvml.nvmlDeviceGetName(handle)
            gpus.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "memory_total_bytes": int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total),
                }
            )
        return {
            "gpus": gpus,
            "cpu": {
                "memory_total_bytes": int(psutil.virtual_memory().total),
                "cores": psutil.cpu_count(logical=True) or 1,
            },
        }

    def sample(self) -> dict[str, Any]:
        """{"gpus": [per-GPU figures], "cpu": {utilization_pct, memory_used_bytes, memory_total_bytes}}."""
        memory = psutil.virtual_memory()
        cpu = {
            "utilization_pct": float(psutil.cpu_percent(interval=None)),
            "memory_used_bytes": int(memory.total - memory.available),
            "memory_total_bytes": int(memory.total),
        }
        return {"gpus": [self._gpu_figures(i, h) for i, h in enumerate(self._handles)], "cpu": cpu}

    def _gpu_figures(self, index: int, handle: Any) -> dict[str, Any]:
        nvml = self._nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        figures = {
            "index": index,
            "utilization_pct": 0.0,
            "memory_used_bytes": int(memory.used),
            "memory_total_bytes": int(memory.total),
            "temperature_c": 0.0,
            "power_w": 0.0,
        }
        # Some boards (and MIG slices) do not report every figure: leave those at 0 rather than fail.
        readings = {
            "utilization_pct": lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "temperature_c": lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        }
        for key, read in readings.items():
            try:
                figures[key] = read()
            except nvml.NVMLError:
                pass
        return figures

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
