"""The KV cache's torch dtype from EngineConfig.kv_cache_dtype: "auto" (the model's dtype) or "fp8"
(float8_e4m3fn with per-layer scales, gpuworker.kernels.quant.kv_cache), refused where the device
cannot run it."""

from __future__ import annotations

import torch

from gpuworker.kernels.quant.kv_cache import FP8_DTYPE

# The Triton kernels convert to and from e4m3 with Hopper/Ada instructions (compute capability 8.9+).
FP8_MIN_CAPABILITY = (8, 9)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype != "fp8":
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    device = torch.device(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            needed = ".".join(map(str, FP8_MIN_CAPABILITY))
            raise ValueError(
                f"kv_cache_dtype 'fp8' needs a GPU of compute capability {needed} or newer (Ada, "
                f"Hopper); {device} has {capability[0]}.{capability[1]}: use kv_cache_dtype 'auto'"
            )
    return FP8_DTYPE
