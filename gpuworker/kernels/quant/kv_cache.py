"""The FP8 KV cache's number format: e4m3 values with a static float scale per layer for keys and one
for values.

A write stores clamp(x / scale, -FP8_MAX, FP8_MAX) cast to float8_e4m3fn; a read gives
x.float() * scale. These torch functions are the references (and the torch attention backend's
path); the Triton kernels do the same arithmetic in float32 inside their launches. A cache of the
model's own dtype ignores the scales: it stores the value cast to its dtype and reads it back as is.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
# The largest finite e4m3fn value; larger magnitudes saturate instead of turning into NaN.
FP8_MAX = 448.0


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_DTYPE


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x (keys or values) as the cache stores them."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    # The divisor is a tensor on x's device, not a Python number: CUDA's torch divides by a host scalar
    # as a product with its float32 reciprocal, which rounds a value in ~10^6 to another e4m3 step than
    # the IEEE division the kernels (and torch on the CPU) do.
    divisor = torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached keys or values in float32."""
    if x.dtype != FP8_DTYPE:
        return x.float()
    return x.float() * scale


def check_kv_scale(name: str, scale: object) -> float:
    """A static scale must be a positive finite number (it divides every cached value)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
    return float(scale)


def check_kv_scales(k_scale: object, v_scale: object) -> tuple[float, float]:
    """A kernel's k_scale and v_scale arguments, checked (check_kv_scale)."""
    return check_kv_scale("k_scale", k_scale), check_kv_scale("v_scale", v_scale)
