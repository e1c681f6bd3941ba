"""The paged-KV inference engine.

    from gpuworker.engine import LLMEngine, SamplingParams, start_engine

Names are imported on first use, so the torch-free modules (sequence, block_manager, scheduler,
sampling_params, config) can be imported and tested without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLMEngine": "gpuworker.engine.llm_engine",
    "AsyncLLMEngine": "gpuworker.engine.async_engine",
    "start_engine": "gpuworker.engine.async_engine",
    "EngineFacts": "gpuworker.engine.facts",
    "SamplingParams": "gpuworker.engine.sampling_params",
    "EngineConfig": "gpuworker.engine.config",
    "RequestOutput": "gpuworker.engine.outputs",
    "CompletionOutput": "gpuworker.engine.outputs",
    "RequestMetrics": "gpuworker.engine.outputs",
    "TokenLogprob": "gpuworker.engine.outputs",
    "StepStats": "gpuworker.engine.outputs",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from gpuworker.engine.async_engine import AsyncLLMEngine, start_engine
    from gpuworker.engine.config import EngineConfig
    from gpuworker.engine.facts import EngineFacts
    from gpuworker.engine.llm_engine import LLMEngine
    from gpuworker.engine.outputs import (CompletionOutput, RequestMetrics, RequestOutput, StepStats,
                                          TokenLogprob)
    from gpuworker.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
