"""The Celery tasks the control plane sends to a worker daemon's own queue: names and arguments.

    LoadModel(replica_id=7, model_path="/models/m", served_model_name="m", gpu_index=0,
              memory_fraction=0.4).as_kwargs()          # the control plane, sending
    parse_task(LOAD_MODEL, args, kwargs)                 # the daemon, receiving

Arguments are checked when a task is built, on either side, so a bad one fails where it is made;
`TaskArgumentError` names the field and its limit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

LOAD_MODEL, UNLOAD_MODEL, DRAIN_WORKER = "gpuworker.load_model", "gpuworker.unload_model", "gpuworker.drain_worker"
STAGE_WEIGHTS = "gpuworker.stage_weights"
MEASURE_QUALITY = "gpuworker.measure_quality"
MAX_STAGED_MODELS = 64
DTYPES = ("auto", "float32", "float16", "bfloat16")
# How a MoE model split over ranks joins its experts (the engine's EngineConfig.expert_parallel).
EXPERT_PARALLEL_MODES = ("all_reduce", "all_to_all")
# What a float checkpoint may be quantized to at load ("": served as stored); the engine's
# checkpoint_quantization.LOAD_QUANTIZATIONS, spelled for JSON.
LOAD_QUANTIZATIONS = ("", "fp8")
MAX_TIMEOUT_S = 3600.0
# The longest context a replica is asked to serve, in tokens: past it a typo, not a wish (a
# million-token sequence already needs a block-table row of 256 KiB per slot, engine.sizing).
MAX_MODEL_LEN = 1 << 22


class TaskArgumentError(ValueError):
    pass


# -- argument checks: each returns the value or raises TaskArgumentError naming field and limit --


def _int_at_least(minimum: int, optional: bool = False, maximum: int | None = None) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise TaskArgumentError(f"{name} must be an integer {bound}{' or null' if optional else ''}, got {value!r}")
        return value

    return check


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TaskArgumentError(f"{name} must be true or false, got {value!r}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 4096:
        raise TaskArgumentError(f"{name} must be a non-empty string of at most 4096 characters, got {value!r}")
    return value


def _number_in(low: float, high: float, low_open: bool = False) -> Callable[[str, Any], float]:
    def check(name: str, value: Any) -> float:
        ok = (
            not isinstance(value, bool)
            and isinstance(value, (int, float))
            and (low < value if low_open else low <= value)
            and value <= high
        )
        if not ok:
            raise TaskArgumentError(
                f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}"
            )
        return float(value)

    return check


def _dtype(name: str, value: Any) -> str:
    if value not in DTYPES:
        raise TaskArgumentError(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")
    return value


def _expert_parallel(name: str, value: Any) -> str:
    if value not in EXPERT_PARALLEL_MODES:
        raise TaskArgumentError(f"{name} must be one of {', '.join(EXPERT_PARALLEL_MODES)}, got {value!r}")
    return value


def _load_quantization(name: str, value: Any) -> str:
    if value not in LOAD_QUANTIZATIONS:
        raise TaskArgumentError(f"{name} must be one of {', '.join(map(repr, LOAD_QUANTIZATIONS))}, got {value!r}")
    return value


def _model_paths(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_STAGED_MODELS:
        raise TaskArgumentError(f"{name} must be a list of at most {MAX_STAGED_MODELS} paths, got {value!r}")
    paths = tuple(_text(f"{name}[{i}]", path) for i, path in enumerate(value))
    if len(set(paths)) != len(paths):
        raise TaskArgumentError(f"{name} must not repeat a path, got {value!r}")
    return paths


def _argument(check: Callable[[str, Any], Any], default: Any = dataclasses.MISSING) -> Any:
    return field(default=default, metadata={"check": check})


class _Task:
    NAME: ClassVar[str]

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            object.__setattr__(self, spec.name, spec.metadata["check"](spec.name, getattr(self, spec.name)))

    def as_kwargs(self) -> dict[str, Any]:
        # Tuples go as JSON arrays; parsing turns them back.
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class LoadModel(_Task):
    """Start a replica of the checkpoint at model_path on GPU gpu_index (None: the CPU); with
    tensor_parallel_size N, split over GPUs gpu_index..gpu_index+N-1 (or N CPU processes), a MoE
    model's experts joined as expert_parallel says; a vision model's replica refuses images beyond
    the max_image* limits; quantization "fp8" serves a float checkpoint quantized to FP8 at load;
    max_model_len past the checkpoint's context only with allow_long_context."""

    NAME: ClassVar[str] = LOAD_MODEL
    replica_id: int = _argument(_int_at_least(0))
    model_path: str = _argument(_text)
    served_model_name: str = _argument(_text)
    gpu_index: int | None = _argument(_int_at_least(0, optional=True))
    memory_fraction: float = _argument(_number_in(0.0, 1.0, low_open=True))
    max_model_len: int | None = _argument(_int_at_least(1, optional=True, maximum=MAX_MODEL_LEN), None)
    # True: a max_model_len past the checkpoint's max_position_embeddings is served (the replica's
    # --allow-long-context); False: the replica refuses it and the load fails, saying so.
    allow_long_context: bool = _argument(_flag, False)
    dtype: str = _argument(_dtype, "auto")
    tensor_parallel_size: int = _argument(_int_at_least(1), 1)
    expert_parallel: str = _argument(_expert_parallel, "all_reduce")
    # A vision model's limits on one chat request's images (the catalog's); None: the replica's defaults.
    max_images_per_request: int | None = _argument(_int_at_least(1, optional=True), None)
    max_image_bytes: int | None = _argument(_int_at_least(1, optional=True), None)
    max_image_pixels: int | None = _argument(_int_at_least(1, optional=True), None)
    low_detail_pixels: int | None = _argument(_int_at_least(1, optional=True), None)
    # "fp8": quantize the float checkpoint's weights to FP8 as it loads (the catalog's load_quantization).
    quantization: str = _argument(_load_quantization, "")


@dataclass(frozen=True)
class UnloadModel(_Task):
    """Drain the replica (in-flight requests get drain_timeout_s), then stop it."""

    NAME: ClassVar[str] = UNLOAD_MODEL
    replica_id: int = _argument(_int_at_least(0))
    drain_timeout_s: float = _argument(_number_in(0.0, MAX_TIMEOUT_S), 30.0)


@dataclass(frozen=True)
class DrainWorker(_Task):
    """Take no more loads and unload every replica within timeout_s."""

    NAME: ClassVar[str] = DRAIN_WORKER
    timeout_s: float = _argument(_number_in(0.0, MAX_TIMEOUT_S), 60.0)


@dataclass(frozen=True)
class StageWeights(_Task):
    """Keep these checkpoints' weight files warm in host memory (the page cache), first ones first,
    within the worker's staging budget, and let go of any other: the whole desired list, so a
    repeated or late message is harmless. Sent to a worker whose list changed."""

    NAME: ClassVar[str] = STAGE_WEIGHTS
    model_paths: tuple[str, ...] = _argument(_model_paths)


@dataclass(frozen=True)
class MeasureQuality(_Task):
    """Measure the perplexity of the checkpoint at model_path (python -m gpuworker.quality) in a
    process of its own on GPU gpu_index (None: the CPU), quantized as `quantization` says, and post
    the report (or why it failed) to the control plane as measurement measurement_id. window and
    max_tokens: the command's options (None: its defaults, the whole evaluation text)."""

    NAME: ClassVar[str] = MEASURE_QUALITY
    measurement_id: int = _argument(_int_at_least(1))
    model_path: str = _argument(_text)
    gpu_index: int | None = _argument(_int_at_least(0, optional=True))
    quantization: str = _argument(_load_quantization, "")
    window: int | None = _argument(_int_at_least(2, optional=True), None)
    max_tokens: int | None = _argument(_int_at_least(2, optional=True), None)


WorkerTask = LoadModel | UnloadModel | DrainWorker | StageWeights | MeasureQuality
TASKS: dict[str, type[_Task]] = {
    task.NAME: task for task in (LoadModel, UnloadModel, DrainWorker, StageWeights, MeasureQuality)
}


def parse_task(name: str, args: tuple, kwargs: dict[str, Any]) -> WorkerTask:
    """The task `name` called with these arguments, defaults filled in, or TaskArgumentError."""
    task = TASKS[name]
    expected = [spec.name for spec in dataclasses.fields(task)]
    if args:
        raise TaskArgumentError(f"takes keyword arguments only, got {len(args)} positional argument(s)")
    unknown = sorted(set(kwargs) - set(expected))
    if unknown:
        raise TaskArgumentError(f"unexpected argument(s) {', '.join(unknown)}; expected {', '.join(expected)}")
    for spec in dataclasses.fields(task):
        if spec.name not in kwargs and spec.default is dataclasses.MISSING:
            raise TaskArgumentError(f"{spec.name} is required")
    return task(**kwargs)
