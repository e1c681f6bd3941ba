"""Tuned launch configurations as data: one JSON file per kernel and GPU, configs/<kernel>/<device>.json.

<kernel> is the kernel the configurations launch (`_<name>_kernel`: block_fp8_matmul, gemv,
int4_gemv, int4_matmul, paged_decode, sample; moe_decode for the two kernels of the MoE decode
path). <device> is the GPU's name as torch.cuda.get_device_name gives it, made file-safe
(file_name: "NVIDIA H200" -> NVIDIA_H200.json). A file lists records, each the shape and dtype it
applies to (the fields the file's "key" names) and what was chosen there; "note" is for people:

    {"kernel": "gemv", "device": "NVIDIA H200", "key": ["weight_dtype", "n", "k", "m"],
     "configs": [{"weight_dtype": "bfloat16", "n": 6144, "k": 4096, "m": 1, "config": "fma-n16-k512-w4-p1",
                  "note": "Llama-3-8B qkv"}, ...]}

The sweep scripts under bench/ write them (--write-configs, through write()); kernels read them
through table(), by the name of the device they launch on, once per file. Where a device has no
file, or a file no record for a shape, the kernel takes its own defaults in code (GEMV: cuBLAS), so
a table measured on one GPU never picks for another.

The Triton interpreter (CPU tests) has no GPU of its own: a device other than CUDA looks up
INTERPRETER_DEVICE's tables, those of the GPU the tests stand in for and whose sm_90 PTX
tests/kernels/ptx_inventory.py compiles their launches for, so that the interpreter launches what
that GPU launches.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

CONFIG_DIR = Path(__file__).resolve().parent
INTERPRETER_DEVICE = "NVIDIA H200"
NOTE = "note"

_NAMES: dict[int, str] = {}


def device_name(device: torch.device | str | None = None) -> str:
    """The name of the GPU `device` is (None: the current CUDA device), or INTERPRETER_DEVICE for a
    device other than CUDA (or None without CUDA)."""
    if device is None:
        if not torch.cuda.is_available():
            return INTERPRETER_DEVICE
        index = torch.cuda.current_device()
    else:
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if device.type != "cuda":
            return INTERPRETER_DEVICE
        index = device.index if device.index is not None else torch.cuda.current_device()
    name = _NAMES.get(index)
    if name is None:
        name = _NAMES[index] = torch.cuda.get_device_name(index)
    return name


def file_name(name: str) -> str:
    """The file of a device's configurations: its name with each run of characters other than
    letters, digits, '.' and '-' replaced by '_', and .json."""
    safe = re.sub(r"[^A-Za-z0-9.-]+", "_", name.strip()).strip("._")
    if not safe:
        raise ValueError(f"a device name must have a letter or digit, got {name!r}")
    return f"{safe}.json"


def config_path(kernel: str, name: str, directory: Path | None = None) -> Path:
    """Where `kernel`'s configurations for the device called `name` live."""
    return (CONFIG_DIR if directory is None else directory) / kernel / file_name(name)


def table(
    kernel: str, key: tuple[str, ...], device: torch.device | str | None = None, build: Callable[..., Any] | None = None
) -> Mapping[tuple, Any]:
    """`kernel`'s records for the device (device_name's), indexed by their key values in the order of
    `key` (which must be the file's key): {key values: build(**the other fields)}, or read-only dicts
    of the other fields without `build`. Empty where the device has no file. Read once per file and
    `build`; the result must not be modified."""
    return _table(CONFIG_DIR, kernel, device_name(device), tuple(key), build)


@functools.lru_cache(maxsize=None)
def _table(
    directory: Path, kernel: str, name: str, key: tuple[str, ...], build: Callable[..., Any] | None
) -> Mapping[tuple, Any]:
    records = _read(config_path(kernel, name, directory), key)
    out = {}
    for index, values in records.items():
        fields = {name: value for name, value in values.items() if name not in key and name != NOTE}
        out[index] = build(**fields) if build is not None else MappingProxyType(fields)
    return MappingProxyType(out)


def _read(path: Path, key: tuple[str, ...]) -> dict[tuple, dict]:
    """path's records by key values ({} if there is no file), checked against `key`."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("configs"), list):
        raise ValueError(f'{path} must be an object with a "configs" list')
    if tuple(data.get("key", ())) != key:
        raise ValueError(f"{path} is keyed by {data.get('key')!r}, expected {list(key)!r}")
    records: dict[tuple, dict] = {}
    for record in data["configs"]:
        index = _index(record, key, path)
        if index in records:
            raise ValueError(f"{path} has two records for {dict(zip(key, index))}")
        records[index] = record
    return records


def _index(record: Any, key: tuple[str, ...], where: object) -> tuple:
    if not isinstance(record, dict) or any(name not in record for name in key):
        raise ValueError(f"{where}: a record must be an object with the key fields {list(key)}, got {record!r}")
    return tuple(record[name] for name in key)


def bucket(value: int, buckets: Iterable[int]) -> int | None:
    """The smallest of `buckets` holding `value` (>= it), None if none does."""
    return min((b for b in buckets if b >= value), default=None)


def write(
    kernel: str,
    key: tuple[str, ...],
    records: Iterable[dict],
    *,
    device: str,
    remove: Iterable[dict] = (),
    directory: Path | None = None,
) -> Path:
    """Merge `records` into `kernel`'s file for the device called `device` (in `directory`, default
    CONFIG_DIR) and return its path: a record replaces the one with the same key values, records
    whose key values are in `remove` go, the others stay. Written whole (a temporary file renamed),
    records sorted by key."""
    key = tuple(key)
    path = config_path(kernel, device, directory)
    merged = _read(path, key)
    for record in remove:
        merged.pop(_index(record, key, "remove"), None)
    for record in records:
        merged[_index(record, key, "records")] = dict(record)
    ordered = sorted(merged.values(), key=lambda r: tuple((type(r[name]).__name__, r[name]) for name in key))
    lines = [f"    {json.dumps(record)}" for record in ordered]
    text = (
        "{\n"
        f'  "kernel": {json.dumps(kernel)},\n'
        f'  "device": {json.dumps(device)},\n'
        f'  "key": {json.dumps(list(key))},\n'
        '  "configs": [\n' + ",\n".join(lines) + ("\n" if lines else "") + "  ]\n}\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)
    _table.cache_clear()
    return path
