"""The device side of a loop over a row's blocks with the next blocks' loads in flight (the sampling
kernel's passes, which are latency-bound on their loads otherwise):

    pre1, pre2, pre3 = prefetch.first_blocks(ptr, first, end, BLOCK, PREFETCH)
    for start in range(first, end, BLOCK):
        x, pre1, pre2, pre3 = prefetch.next_block(ptr, start + tl.arange(0, BLOCK), end, pre1, pre2, pre3,
                                                  BLOCK, PREFETCH)

PREFETCH (0 to 3) blocks ahead of the one being reduced are loaded; slots past PREFETCH are unused
(the compiler drops them). Values past `end` read -inf. Kernels call these through the module, so
the interpreter's launches can swap in interpretable twins (launch.py); it imports nothing of ours.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load(ptr, idx, end):
    return tl.load(ptr + idx, mask=idx < end, other=float("-inf"))


@triton.jit
def first_blocks(ptr, first, end, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """(pre1, pre2, pre3): the loads of the PREFETCH blocks from `first`, put in flight before the loop."""
    idx = first + tl.arange(0, BLOCK)
    pre1 = _load(ptr, idx, end)
    pre2 = pre1
    pre3 = pre1
    if PREFETCH >= 2:
        pre2 = _load(ptr, idx + BLOCK, end)
    if PREFETCH >= 3:
        pre3 = _load(ptr, idx + 2 * BLOCK, end)
    return pre1, pre2, pre3


@triton.jit
def next_block(ptr, idx, end, pre1, pre2, pre3, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """(the block at idx in float32, pre1, pre2, pre3): without prefetch loaded now, else the oldest
    slot's, the slots moved up and the load PREFETCH blocks ahead put in the last."""
    if PREFETCH == 0:
        raw = _load(ptr, idx, end)
    else:
        raw = pre1
        if PREFETCH == 1:
            pre1 = _load(ptr, idx + BLOCK, end)
        elif PREFETCH == 2:
            pre1 = pre2
            pre2 = _load(ptr, idx + 2 * BLOCK, end)
        else:
            pre1 = pre2
            pre2 = pre3
            pre3 = _load(ptr, idx + 3 * BLOCK, end)
    return raw.to(tl.float32), pre1, pre2, pre3
