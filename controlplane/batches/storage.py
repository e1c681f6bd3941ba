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


class ChunkWriter:
    """A file written chunk by chunk as it arrives, counted and bounded: `write` raises
    FileTooLarge past `max_bytes`, `finish` past `max_lines` (a last line without its newline
    counts too). Past the line limit nothing more is kept but the bytes are still counted, so that
    an upload past both limits is refused for its size, however it is cut into chunks. Whatever
    fails leaves nothing behind; `finish` puts the file in place under `name`, `discard` drops it
    (finished or not)."""

    def __init__(self, name: str, *, max_bytes: int, max_lines: int):
        self.name, self._max_bytes, self._max_lines = name, max_bytes, max_lines
        self._path = path_of(name)
        self._partial = self._path.with_suffix(".partial")
        self._out = open(self._partial, "wb")  # noqa: SIM115 (closed by finish or discard)
        self._size = self._newlines = 0
        self._last = b"\n"

    def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        try:
            self._size += len(chunk)
            if self._size > self._max_bytes:
                raise too_many_bytes(self._max_bytes)
            if self._newlines > self._max_lines:
                return  # refused at finish
            self._newlines += chunk.count(b"\n")
            self._last = chunk[-1:]
            if self._newlines > self._max_lines:
                self.discard()
                return
            self._out.write(chunk)
        except BaseException:
            self.discard()
            raise

    def finish(self) -> Stored:
        try:
            lines = self._newlines + (self._last != b"\n")
            if lines > self._max_lines:
                raise FileTooLarge(f"file: more than the limit of {self._max_lines:,} lines.", "lines")
            self._out.close()
            self._partial.replace(self._path)
        except BaseException:
            self.discard()
            raise
        return Stored(self.name, self._size, lines)

    def discard(self) -> None:
        self._out.close()
        self._partial.unlink(missing_ok=True)
        self._path.unlink(missing_ok=True)


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
