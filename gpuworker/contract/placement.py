"""How a replica's memory splits over the GPUs it is placed on, as the control plane places
replicas and a worker checks a load before starting it: each of N tensor-parallel ranks holds
1/N, and the fewest GPUs that hold a model is a power of two up to MAX_TENSOR_PARALLEL_SIZE (one
for the quantizations that do not split)."""

from __future__ import annotations

# More GPUs than one host holds; past it a typo, not a wish.
MAX_TENSOR_PARALLEL_SIZE = 16
# Checkpoint quantizations (contract.heartbeat.QUANTIZATION_LABELS) a replica runs on one GPU only:
# their packed INT4 weights and per-group scales are not split over ranks
# (models.tensor_parallel.check_quantized_split). FP8 checkpoints split.
UNSPLIT_QUANTIZATIONS = ("awq-int4", "gptq-int4")


def gpu_share_bytes(*, need_bytes: int, tensor_parallel_size: int) -> int:
    """A replica's memory on each of its GPUs: each rank holds 1/N of the weights and of the KV cache."""
    return -(-need_bytes // tensor_parallel_size)


def gpus_needed(*, need_bytes: int, gpu_bytes: int) -> int | None:
    """The fewest GPUs of `gpu_bytes` each that hold `need_bytes` split over them (gpu_share_bytes
    on each): a power of two, the sizes the heads and experts of the served families divide by;
    None when even MAX_TENSOR_PARALLEL_SIZE GPUs (more than a host) do not."""
    size = 1
    while size <= MAX_TENSOR_PARALLEL_SIZE:
        if gpu_share_bytes(need_bytes=need_bytes, tensor_parallel_size=size) <= gpu_bytes:
            return size
        size *= 2
    return None
