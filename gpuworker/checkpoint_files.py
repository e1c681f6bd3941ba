"""Which files hold a Hugging Face checkpoint's weights, their safetensors headers, and readahead.

Imports no torch, so the replica can start reading its weights from disk the moment it starts
(`prefetch`), while torch and CUDA initialise, and the daemon can stage checkpoints in the page
cache without loading the engine. The loader (gpuworker/models/loader.py) reads the same list.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GGUF_SUFFIX = ".gguf"
# A safetensors header is JSON of a few hundred bytes per tensor; past this the file is not one.
MAX_HEADER_BYTES = 100 * 1024 * 1024
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
READ_BYTES = 16 << 20
# Below this share of its bytes in the page cache a checkpoint counts as cold: read it in file
# order, one stream, as a disk reads fastest.
WARM_FRACTION = 0.9
# Element sizes of the safetensors dtypes the engine can load.
DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def read_json(file: Path, required: bool) -> dict[str, Any] | None:
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"{file} does not exist; expected a Hugging Face model directory")
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names (the file itself, or the only .gguf in a directory without a
    config.json); None when `path` is a Hugging Face directory or does not exist."""
    path = Path(path)
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    if len(files) > 1:
        raise ValueError(
            f"{path} holds {len(files)} {GGUF_SUFFIX} files ({', '.join(f.name for f in files)}); name the one to load"
        )
    return files[0] if files else None


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors shards named by the index, the single model.safetensors, or the GGUF file."""
    gguf = gguf_file(directory)
    if gguf is not None:
        return [gguf]
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: expected a non-empty 'weight_map' object")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file.name}, listed in {index_path}, does not exist")
        return files
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise FileNotFoundError(f"{directory}: no weights found; expected {INDEX_FILE} or {SINGLE_FILE}")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype, shape and byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def read_header(file: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file in file order, checked against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file.name} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"{file.name} is not a safetensors file or is truncated (header length {length}, file size {size})"
            )
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{file.name}: the safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{file.name}: the safetensors header is not a JSON object")
    base, entries = 8 + length, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{file.name}: bad header entry for {name}: {info!r}") from exc
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"{name} in {file.name} has dtype {dtype}; supported: {', '.join(DTYPE_SIZES)}")
        count = 1
        for d in shape:
            count *= d
        if not (0 <= begin <= end and end - begin == count * DTYPE_SIZES[dtype] and base + end <= size):
            raise ValueError(
                f"{name} in {file.name}: data offsets {begin}-{end} do not fit its shape "
                f"{shape} ({dtype}) or the file ({size} bytes); the file may be truncated"
            )
        entries.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    entries.sort(key=lambda e: e.begin)
    return entries


def weight_bytes(directory: Path) -> int:
    return sum(file.stat().st_size for file in checkpoint_files(directory))


def advise(files: list[Path], advice: int) -> None:
    """posix_fadvise the whole of each file; a file that vanished meanwhile is skipped."""
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError as exc:
            logger.debug("posix_fadvise(%s) failed: %s", file, exc)
        finally:
            os.close(fd)


# mincore(2) through ctypes: Python has no binding, and it is the only way to ask which pages of a
# file are in memory without reading them.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(file: Path) -> int:
    """Bytes of `file` in the page cache now (0 for a file that cannot be mapped)."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        address = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if address in (None, _MAP_FAILED):
            return 0
        try:
            pages = -(-size // PAGE_BYTES)
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                return 0
            # The low bit of each byte says resident; the other bits are unused (zero).
            resident = pages - bytes(vector).count(0)
            return min(size, resident * PAGE_BYTES)
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def resident_fraction(files: list[Path]) -> float:
    total = sum(f.stat().st_size for f in files)
    return sum(resident_bytes(f) for f in files) / total if total else 1.0


def read_through(files: list[Path]) -> None:
    """Read the files once, in order, with large reads: into the page cache at the disk's pace."""
    buffer = bytearray(READ_BYTES)
    for file in files:
        try:
            with open(file, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
        except OSError as exc:
            logger.debug("reading %s ahead failed: %s", file, exc)


def prefetch(directory: str | Path) -> threading.Thread | None:
    """Read a cold checkpoint's weight files into the page cache in a background thread, file
    after file: a replica calls this first thing, so the disk streams while Python imports torch
    and CUDA starts, and the loader then finds the pages read or in flight. Nothing to do (None)
    when the files are in the page cache already or unreadable (the loader will say why)."""
    try:
        files = checkpoint_files(Path(directory))
        if resident_fraction(files) >= WARM_FRACTION:
            return None
    except (OSError, ValueError):
        return None
    thread = threading.Thread(target=read_through, args=(files,), name="weights-readahead", daemon=True)
    thread.start()
    return thread
