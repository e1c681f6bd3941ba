"""Incremental scanning of the JSON a tool call is written in, as its text arrives: where a
value ends, where a call object's name and arguments are, and whether the text so far can still
become a call (`Malformed`) or simply has not ended yet (`Incomplete`). Used by
`gpuworker.replica.tool_calls.ToolCallParser`.
"""

from __future__ import annotations

import json


class Incomplete(Exception):
    """The text ends before the JSON value does."""


class Malformed(Exception):
    """The text cannot be the JSON a call is written in."""


_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """Index after the JSON string starting at text[i] == '"'."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    raise Incomplete


class ValueScanner:
    """Finds the end of one JSON value, fed text as it arrives (strings, nesting, escapes); keeps
    its place, so a long streamed argument object is scanned once."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.kind = ""
        self.in_string = False
        self.escape = False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        while self.end is None and self.pos < len(text):
            c = text[self.pos]
            if not self.kind:
                self.kind = c
                if c in "{[":
                    self.depth = 1
                elif c == '"':
                    self.in_string = True
                elif c in "]},:":
                    raise Malformed
            elif self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.kind == '"':
                        self.end = self.pos + 1
            elif self.kind in "{[":
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == 0:
                        self.end = self.pos + 1
            elif c in _WS or c in ",}]":  # a literal (number, true, false, null) ends here
                self.end = self.pos
                break
            self.pos += 1
        return self.end


class CallScanner:
    """Reads one call's JSON object ({"name": ..., "arguments": ...}) as its text arrives."""

    def __init__(self, argument_keys: tuple[str, ...]) -> None:
        self.argument_keys = argument_keys
        self.text = ""
        self.name: str | None = None
        self.args_start: int | None = None
        self.args = ValueScanner()
        self.end: int | None = None  # index after the object's closing brace
        self.malformed = False

    @property
    def args_end(self) -> int | None:
        return None if self.args_start is None or self.args.end is None else self.args_start + self.args.end

    def feed(self, text: str) -> None:
        """Reads on; sets `malformed` (keeping what was read before) when the text cannot be a call."""
        self.text += text
        if self.end is not None or self.malformed:
            return
        try:
            if self.args_start is not None and self.args_end is None:
                self.args.scan(self.text[self.args_start :])
                if self.args_end is None:
                    return
            self._members()
        except Malformed:
            self.malformed = True

    def _members(self) -> None:
        text = self.text
        i = skip_ws(text, 0)
        if i >= len(text):
            return
        if text[i] != "{":
            raise Malformed
        i += 1
        try:
            while True:
                i = skip_ws(text, i)
                if i >= len(text):
                    return
                if text[i] == "}":
                    self.end = i + 1
                    return
                if text[i] == ",":
                    i += 1
                    continue
                if text[i] != '"':
                    raise Malformed
                key_end = _string_end(text, i)
                key = json.loads(text[i:key_end])
                i = skip_ws(text, key_end)
                if i >= len(text):
                    return
                if text[i] != ":":
                    raise Malformed
                i = skip_ws(text, i + 1)
                if i >= len(text):
                    return
                if key in self.argument_keys and (self.args_start is None or self.args_start == i):
                    self.args_start = i
                    self.args.scan(text[i:])
                    if self.args_end is None:
                        return
                    i = self.args_end
                    continue
                value = ValueScanner()
                end = value.scan(text[i:])
                if end is None:
                    return
                if key == "name":
                    name = json.loads(text[i : i + end])
                    if not isinstance(name, str) or not name:
                        raise Malformed
                    self.name = name
                i += end
        except (Incomplete, ValueError) as exc:
            if isinstance(exc, Incomplete):
                return
            raise Malformed from None
