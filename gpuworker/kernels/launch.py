"""What every kernel launcher shares: lazy JIT (so TRITON_INTERPRET is read at launch) and argument checks.

`triton.jit` decides between the compiler and the CPU interpreter when it decorates a function. A
test run that imports this package before its conftest sets TRITON_INTERPRET=1 would otherwise be
stuck with compiled kernels that cannot take CPU tensors, so kernels are decorated on first launch,
once per mode.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl

from gpuworker.kernels.quant.kv_cache import FP8_DTYPE

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What a KV cache may hold: the keys' own dtype, or FP8 with scales (kernels/kv_cache_quant.py).
KV_CACHE_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class LazyJIT:
    """A Triton kernel function, jitted when first launched and again if the interpreter flag flips.

    do_not_specialize: arguments whose values change from step to step (slices of the step's
    metadata, table widths, split counts). Triton compiles a variant per pattern of "pointer 16-byte
    aligned", "integer divisible by 16" and "integer == 1" among its arguments; left specialised,
    such arguments make a running server compile new variants (about a second each) in the middle
    of its steps. Named arguments get neither specialisation.
    """

    def __init__(self, fn: Callable[..., Any], do_not_specialize: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self.do_not_specialize = do_not_specialize
        self._by_mode: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        mode = interpreting()
        kernel = self._by_mode.get(mode)
        if kernel is None:
            kernel = triton.jit(self.fn, **_no_specialization(self.do_not_specialize))
            self._by_mode[mode] = kernel
        launch = kernel[grid]
        if not mode:
            return launch

        def interpreted(*args: Any, **kwargs: Any) -> Any:
            with _interpretable_stdlib():
                return launch(*args, **kwargs)

        return interpreted


_INTERPRETED_STDLIB: dict[int, Any] = {}


@contextmanager
def _interpretable_stdlib() -> Iterator[None]:
    """Let the interpreter call tl.max, tl.sum & co. (and every @triton.jit device function of this
    package) even if triton was imported before TRITON_INTERPRET=1.

    Triton's own @jit helpers (triton.language.standard) are decorated when triton is imported; if
    that happened without the flag they are compiled-mode functions that the interpreter refuses to
    call. For the duration of an interpreted launch they are swapped for interpreted twins and then
    restored, so compiled kernels in the same process are unaffected.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = []
    for module in (tl, tl.standard, *_device_modules()):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                twin = _INTERPRETED_STDLIB.get(id(value))
                if twin is None:
                    twin = _INTERPRETED_STDLIB[id(value)] = InterpretedFunction(value.fn)
                saved.append((module, name, value))
                setattr(module, name, twin)
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def _device_modules() -> list[ModuleType]:
    """Every imported module of this package: wherever a kernel family keeps its @triton.jit device
    functions (kernels/device/ for shared ones, a family's own modules for its private ones)."""
    package = __name__.rpartition(".")[0] + "."
    return [module for name, module in list(sys.modules.items()) if name.startswith(package) and module is not None]


def lazy_jit(fn: Callable[..., Any], do_not_specialize: tuple[str, ...] = ()) -> LazyJIT:
    return LazyJIT(fn, do_not_specialize)


def _no_specialization(names: tuple[str, ...]) -> dict[str, list[str]]:
    """triton.jit's keywords that turn off value and alignment specialisation of `names`, for the
    keywords this Triton has (both exist in 3.6 and 3.9)."""
    if not names:
        return {}
    accepted = inspect.signature(triton.jit).parameters
    return {key: list(names) for key in ("do_not_specialize", "do_not_specialize_on_alignment") if key in accepted}


_PDL_DEVICES: dict[int, bool] = {}


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch keywords for programmatic dependent launch (PDL) of a kernel on `device`.

    With PDL (Hopper and later, CUDA only) a kernel is launched while the one before it on the stream
    is still running: its programs become resident as the previous kernel's last programs start,
    wait in `gdc_wait` for that kernel to finish and its writes to be visible, then let the next
    kernel launch the same way (`gdc_launch_dependents`). This hides the launch gap between kernels,
    which at batch 1 is several hundred of them per step, also inside CUDA graphs. Every kernel
    launched with it waits before touching memory that kernels write (a GEMV may read its weights
    first: gemv's prefetch), so ordering is that of a plain stream. The attention kernels let the
    next one launch before they wait, so that a GEMV after them loads weights while they run. Kernels
    take USE_PDL (constexpr) for the two calls; off under the interpreter, on older GPUs, with a
    Triton without them, or when GPUWORKER_PDL=0 (for A/B measurements).
    """
    enabled = (
        device.type == "cuda"
        and not interpreting()
        and os.environ.get("GPUWORKER_PDL", "1") != "0"
        and _pdl_supported(device)
    )
    return {"USE_PDL": True, "launch_pdl": True} if enabled else {"USE_PDL": False}


def _pdl_supported(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    supported = _PDL_DEVICES.get(index)
    if supported is None:
        from triton.language.extra import cuda as tl_cuda

        supported = (
            torch.cuda.get_device_capability(index)[0] >= 9
            and hasattr(tl_cuda, "gdc_wait")
            and hasattr(tl_cuda, "gdc_launch_dependents")
        )
        _PDL_DEVICES[index] = supported
    return supported


def check_tensor(
    name: str,
    tensor: Any,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    for_kernel: bool = True,
) -> None:
    """Raise ValueError naming `name` when `tensor` is not a tensor of the expected rank/dtype/device.
    for_kernel=False: the tensor goes to torch ops, so any device will do."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if tensor.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValueError(f"{name} must have dtype in ({names}), got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the other inputs are on {device}")
    if for_kernel and tensor.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{name} is on {tensor.device}: Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 to run them on the CPU interpreter)"
        )


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    # Kernels address the innermost dimension as base + d, so it must be unit-stride.
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}")


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()} for shape {tuple(tensor.shape)}")


def check_operand(name: str, tensor: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """A tensor whose shape and dtype the other arguments fix (an output, a bias, a residual): exactly
    `shape` and `dtype`, on `device`, contiguous in its last dimension."""
    check_tensor(name, tensor, dtypes=(dtype,), device=device)
    check_shape(name, tensor, shape)
    check_last_dim_contiguous(name, tensor)


def check_host_bound(name: str, value: Any) -> None:
    """A host-side upper bound that sizes a launch (max_seq_len, max_query_len)."""
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative host int, got {value!r}")


def check_kv_cache(
    kv_cache: Any, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> tuple[int, int, int, int]:
    """Check a per-layer cache [2, num_blocks, block_size, num_kv_heads, head_dim] holding keys of
    `dtype` (as they are, or in FP8); return its sizes."""
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=KV_CACHE_DTYPES, device=device)
    if kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if dtype is not None and kv_cache.dtype not in (dtype, FP8_DTYPE):
        raise ValueError(
            f"kv_cache has dtype {kv_cache.dtype} but the keys/queries are {dtype} "
            f"(a cache holds their dtype or {FP8_DTYPE})"
        )
    check_last_dim_contiguous("kv_cache", kv_cache)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query_and_cache(query: Any, kv_cache: Any) -> tuple[int, int]:
    """Check attention queries [rows, Hq, D] against a cache of their dtype and device holding Hkv
    heads of dim D, Hq a multiple of Hkv; return the cache's block_size and Hkv."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, cache_dim = check_kv_cache(kv_cache, dtype=query.dtype, device=query.device)
    if cache_dim != head_dim:
        raise ValueError(f"kv_cache head_dim {cache_dim} does not match query head_dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    check_last_dim_contiguous("query", query)
    return block_size, num_kv_heads


def check_block_tables(block_tables: Any, num_seqs: int, device: torch.device, *, counted_in: str) -> None:
    """Block tables [num_seqs, max_blocks] of int32/int64; `counted_in` names the argument num_seqs
    was read from, for the error."""
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but {counted_in} has {num_seqs} sequences")
    check_last_dim_contiguous("block_tables", block_tables)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def dot_options(dtype: torch.dtype) -> dict[str, Any]:
    """Constexpr arguments for kernels using tl.dot on `dtype` inputs.

    float32 inputs ask for IEEE products: Triton's default (tf32) loses about three decimal digits,
    which the engine's float32 reference path would notice. DOT_FP32 makes the kernel upcast its
    operands before tl.dot; it is set only under the interpreter for bfloat16, whose tl.dot there
    multiplies the raw uint16 storage (seen with Triton 3.9). Upcasting bfloat16 products is exact,
    so the result is what the tensor cores compute.
    """
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_FP32": interpreting() and dtype == torch.bfloat16,
    }


# Split-K tickets (gemv, the INT4 GEMV), one int32 per column or row block, per device. They must start
# at zero and the kernels leave them at zero, so they are allocated once (a per-call torch.zeros would
# cost a memset launch) and reused; split-K calls sharing them must be ordered, i.e. issued on one
# stream.
SPLIT_K_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_k_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed tickets on `device`, shared by every split-K launch there."""
    counters = SPLIT_K_COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "a split-K GEMV must run once outside CUDA graph capture (a warm-up) before being "
                "captured: its zeroed ticket buffer cannot be created inside a graph"
            )
        counters = torch.zeros(max(count, 16384), dtype=torch.int32, device=device)
        SPLIT_K_COUNTERS[device] = counters
    return counters
