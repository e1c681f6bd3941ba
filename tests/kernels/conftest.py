"""Kernel tests: on a CUDA device at real (Llama-3-8B) shapes, otherwise on Triton's CPU interpreter at
small shapes.

TRITON_INTERPRET is set here, at import, before any kernel launches. gpuworker.kernels decorates its
kernels on first launch and makes triton's own @jit helpers interpretable during interpreted launches
(gpuworker/kernels/launch.py), so it does not matter whether triton or the kernel modules were already
imported by tests collected earlier in the same process.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if ON_CUDA else "cpu"

# Kernel vs float32 reference (which is itself rounded to the dtype at the end).
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# float32 kernels against a torch reference at the GPU's K (4,096 and more): sums of that many terms in
# another order differ by up to ~4e-5.
FLOAT32_LONG_SUMS = {"atol": 1e-4, "rtol": 1e-4}


def build_paged_cache(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    spare_blocks: int = 3,
    table_width: int | None = None,
):
    """A random cache and shuffled block tables holding `seq_lens` tokens per sequence.

    Every block, used or not, holds random data and tables get a padding column of block 0, so a
    kernel that reads past a sequence's end, or through the padding, produces a wrong answer.
    """
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks + 1
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    width = max(per_seq, default=0) + 1 if table_width is None else table_width
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(per_seq):
        block_tables[i, :n] = torch.tensor(order[taken : taken + n], dtype=torch.int32)
        taken += n
    return kv_cache.to(DEVICE), block_tables.to(DEVICE)


def pytest_collection_modifyitems(config, items):
    # Every kernel test runs at real shapes on a CUDA device, so all of them belong to the GPU suite.
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here + os.sep):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def tolerance():
    return lambda dtype: TOLERANCES[dtype]


@pytest.fixture
def paged_cache():
    return build_paged_cache
