"""EngineFacts: what a server reads of a loaded engine, wherever the engine steps (a thread of the
server's process or a process of its own). Fixed once the engine is ready, so reading them needs no
trip to the engine loop; live figures (running, waiting, KV use) come from `serving_figures` instead.
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuworker.engine.config import EngineConfig

if TYPE_CHECKING:
    from gpuworker.models.config import ModelConfig


@dataclass(frozen=True)
class EngineFacts:
    # The longest sequence (prompt and output) the engine accepts.
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # Tokens the KV pool holds (blocks x block size), each rank's pool alike.
    kv_cache_tokens: int
    # Tokens the host KV tier holds (0: none).
    host_kv_cache_tokens: int
    tensor_parallel_size: int
    vocab_size: int
    block_size: int
    # Seconds per start-up stage until the engine was ready (LLMEngine.load_timings then).
    load_timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, config: EngineConfig, model_config: ModelConfig, load_timings: dict[str, float]) -> EngineFacts:
        """The facts of an engine with this resolved config, model and start-up timings so far."""
        return cls(
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_cache_tokens=config.num_kv_blocks * config.block_size,
            host_kv_cache_tokens=config.num_host_kv_blocks * config.block_size,
            tensor_parallel_size=config.tensor_parallel_size,
            vocab_size=model_config.vocab_size,
            block_size=config.block_size,
            load_timings=dict(load_timings),
        )

    @property
    def limits(self) -> dict[str, int]:
        """The engine's sizes, as /health and the ready log show them."""
        return {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "kv_cache_tokens": self.kv_cache_tokens,
            "host_kv_cache_tokens": self.host_kv_cache_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
