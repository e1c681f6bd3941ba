"""Copy safetensors tensors into a model's parameters with one pass over the files and no
intermediate tensors: the bytes go from the file straight into the parameter (CPU), or through a
pair of pinned chunk buffers with asynchronous host-to-device copies (CUDA), so reading the next
chunk overlaps the copy of the last one. Shards are split into byte ranges read by parallel threads
(a page-cache read is a memcpy bound per thread, and a checkpoint has few shards); a cold checkpoint
is read by one thread in file order, as a disk reads fastest.

A tensor stored in another dtype than its parameter (a float32 checkpoint served in bfloat16) is
read on its own and converted; that is the slow path, used by small models.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from gpuworker.checkpoint_files import TensorEntry

TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# Per reader thread, two pinned buffers of this size: large enough that a copy launch is cheap
# next to its bytes, small enough that pinning them costs little at start-up.
CHUNK_BYTES = 64 * 1024 * 1024
MAX_READERS = 8


@dataclass(frozen=True)
class TensorCopy:
    """Checkpoint tensor `entry` goes to `dest`, a contiguous tensor of the same shape (or, with
    `columns` (first, count), of those columns of it: a tensor-parallel rank's shard)."""

    entry: TensorEntry
    dest: torch.Tensor
    columns: tuple[int, int] | None = None

    @property
    def same_dtype(self) -> bool:
        return TORCH_DTYPES[self.entry.dtype] == self.dest.dtype

    @property
    def byte_for_byte(self) -> bool:
        """The file's bytes are dest's bytes: copied without a staging tensor."""
        return self.same_dtype and self.columns is None

    @property
    def nbytes(self) -> int:
        return self.entry.end - self.entry.begin


def copy_tensors(
    plan: list[tuple[Path, list[TensorCopy]]],
    *,
    progress: Callable[[float], None] | None = None,
    num_readers: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Fill every copy's dest from its file; progress(fraction of bytes done) from the reader threads."""
    total = sum(c.nbytes for _, copies in plan for c in copies) or 1
    done, lock = 0, threading.Lock()

    def advance(nbytes: int) -> None:
        nonlocal done
        with lock:
            done += nbytes
            fraction = done / total
        if progress is not None:
            progress(fraction)

    readers = max(1, num_readers or MAX_READERS)
    jobs = split_plan(plan, -(-readers // max(1, len(plan))))
    with ThreadPoolExecutor(min(readers, len(jobs) or 1), thread_name_prefix="weights") as pool:
        futures = [pool.submit(_copy_file, file, copies, advance, chunk_bytes) for file, copies in jobs]
        for future in futures:
            future.result()


def split_plan(plan: list[tuple[Path, list[TensorCopy]]], parts: int) -> list[tuple[Path, list[TensorCopy]]]:
    """Each file's copies in up to `parts` runs of consecutive tensors of about equal bytes, in file
    order (a tensor is never split: the runs of a file of one huge tensor are fewer)."""
    jobs = []
    for file, copies in plan:
        copies = sorted(copies, key=lambda c: c.entry.begin)
        target = sum(c.nbytes for c in copies) / max(1, parts)
        run: list[TensorCopy] = []
        size, runs = 0, 0
        for copy in copies:
            run.append(copy)
            size += copy.nbytes
            if size >= target and runs < parts - 1:
                jobs.append((file, run))
                run, size, runs = [], 0, runs + 1
        if run or not copies:
            jobs.append((file, run))
    return jobs


def _copy_file(file: Path, copies: list[TensorCopy], advance: Callable[[int], None], chunk_bytes: int) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        streamed = [c for c in copies if c.byte_for_byte and c.dest.is_cuda]
        for copy in copies:
            if copy.byte_for_byte and not copy.dest.is_cuda:
                _pread_into(fd, _bytes_of(copy.dest), copy.entry.begin, file)
                advance(copy.nbytes)
            elif not copy.byte_for_byte:
                raw = torch.empty(copy.nbytes, dtype=torch.uint8)
                _pread_into(fd, raw, copy.entry.begin, file)
                tensor = raw.view(TORCH_DTYPES[copy.entry.dtype]).view(copy.entry.shape)
                if copy.columns is not None:
                    tensor = tensor.narrow(1, *copy.columns)
                copy.dest.copy_(tensor)
                advance(copy.nbytes)
        if streamed:
            _stream_to_device(fd, file, streamed, advance, chunk_bytes)
    finally:
        os.close(fd)


def _stream_to_device(
    fd: int, file: Path, copies: list[TensorCopy], advance: Callable[[int], None], chunk_bytes: int
) -> None:
    """Read the span of `copies` chunk by chunk into two alternating pinned buffers; each chunk's
    pieces go to their parameters by async copies on this thread's stream."""
    copies = sorted(copies, key=lambda c: c.entry.begin)
    device = copies[0].dest.device
    stream = torch.cuda.Stream(device)
    span_start, span_end = copies[0].entry.begin, max(c.entry.end for c in copies)
    chunk_bytes = min(chunk_bytes, span_end - span_start)
    buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    events: list[torch.cuda.Event | None] = [None, None]
    first, cursor, k = 0, span_start, 0
    while cursor < span_end:
        stop = min(cursor + chunk_bytes, span_end)
        if events[k] is not None:
            events[k].synchronize()  # its last copies are done: the buffer may be overwritten
        buffer = buffers[k][: stop - cursor]
        _pread_into(fd, buffer, cursor, file)
        copied = 0
        with torch.cuda.stream(stream):
            i = first
            while i < len(copies) and copies[i].entry.begin < stop:
                entry = copies[i].entry
                lo, hi = max(entry.begin, cursor), min(entry.end, stop)
                if lo < hi:
                    _bytes_of(copies[i].dest)[lo - entry.begin : hi - entry.begin].copy_(
                        buffer[lo - cursor : hi - cursor], non_blocking=True
                    )
                    copied += hi - lo
                if entry.end <= stop and i == first:
                    first += 1
                i += 1
            events[k] = torch.cuda.Event()
            events[k].record(stream)
        advance(copied)
        cursor, k = stop, 1 - k
    stream.synchronize()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory."""
    if not tensor.is_contiguous():
        raise ValueError("weights can only be copied into contiguous parameters")
    return tensor.reshape(-1).view(torch.uint8)


def _pread_into(fd: int, dest: torch.Tensor, offset: int, file: Path) -> None:
    """Fill the host tensor `dest` with bytes of fd from offset (os.preadv releases the GIL)."""
    view = memoryview(_bytes_of(dest).numpy())
    filled = 0
    while filled < len(view):
        n = os.preadv(fd, [view[filled:]], offset + filled)
        if n == 0:
            raise ValueError(
                f"{file.name} ended {len(view) - filled} bytes early at offset {offset + filled}; the file is truncated"
            )
        filled += n
