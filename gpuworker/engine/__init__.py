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

if TYPE_CHECKING:  # the redundant aliases mark these as re-exports (__all__ is computed)
    from gpuworker.engine.async_engine import AsyncLLMEngine as AsyncLLMEngine
    from gpuworker.engine.async_engine import start_engine as start_engine
    from gpuworker.engine.config import EngineConfig as EngineConfig
    from gpuworker.engine.facts import EngineFacts as EngineFacts
    from gpuworker.engine.llm_engine import LLMEngine as LLMEngine
    from gpuworker.engine.outputs import CompletionOutput as CompletionOutput
    from gpuworker.engine.outputs import RequestMetrics as RequestMetrics
    from gpuworker.engine.outputs import RequestOutput as RequestOutput
    from gpuworker.engine.outputs import StepStats as StepStats
    from gpuworker.engine.outputs import TokenLogprob as TokenLogprob
    from gpuworker.engine.sampling_params import SamplingParams as SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
