"""Batch files' bytes in the storage folder (settings.BATCH_STORAGE_DIR): written in chunks as
they arrive, counted and bounded on the way, and read back line by line."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

_CHUNK = 1 << 20


class FileTooLarge(ValueError):
    """The upload passed a limit; `field` names which (bytes or lines)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def too_many_bytes(max_bytes: int) -> FileTooLarge:
    """The refusal of an upload past `max_bytes`, wherever it is found (its declared length, the
    bytes received, the bytes stored)."""
    return FileTooLarge(f"file: larger than the limit of {max_bytes:,} bytes.", "bytes")


@dataclass(frozen=True)
class Stored:
    name: str  # relative to the storage folder
    bytes: int
    lines: int


def root() -> Path:
    path = Path(settings.BATCH_STORAGE_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


def path_of(name: str) -> Path:
    return root() / name


def store_chunks(name: str, chunks: Iterable[bytes], *, max_bytes: int, max_lines: int) -> Stored:
    """Write `chunks` to `name`, stopping with FileTooLarge (and nothing left behind) past
    `max_bytes` or `max_lines` (a last line without its newline counts too)."""
    path = path_of(name)
    partial = path.with_suffix(".partial")
    size = newlines = 0
    last = b"\n"
    try:
        with open(partial, "wb") as out:
            for chunk in chunks:
                if not chunk:
                    continue
                size += len(chunk)
                if size > max_bytes:
                    raise too_many_bytes(max_bytes)
                newlines += chunk.count(b"\n")
                last = chunk[-1:]
                if newlines > max_lines:
                    raise FileTooLarge(f"file: more than the limit of {max_lines:,} lines.", "lines")
                out.write(chunk)
        lines = newlines + (last != b"\n")
        if lines > max_lines:
            raise FileTooLarge(f"file: more than the limit of {max_lines:,} lines.", "lines")
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return Stored(name, size, lines)


def store_lines(name: str, lines: Iterable[bytes]) -> Stored:
    """A produced file (output or errors), one JSON document per line."""
    path = path_of(name)
    partial = path.with_suffix(".partial")
    size = count = 0
    with open(partial, "wb") as out:
        for line in lines:
            out.write(line + b"\n")
            size += len(line) + 1
            count += 1
    partial.replace(path)
    return Stored(name, size, count)


def read_lines(name: str) -> Iterator[bytes]:
    with open(path_of(name), "rb") as source:
        yield from source


def read_chunks(name: str) -> Iterator[bytes]:
    with open(path_of(name), "rb") as source:
        while chunk := source.read(_CHUNK):
            yield chunk


def remove(name: str) -> None:
    path_of(name).unlink(missing_ok=True)
