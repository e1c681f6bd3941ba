"""Incremental decoding of a JSON string as its text arrives: the characters it stands for, said
as soon as they are sure, so that a streamed string reaches the client unescaped piece by piece."""

from __future__ import annotations

import re

_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
# Text that may still grow into a low surrogate's escape.
_LOW_SURROGATE_PREFIX = re.compile(r"(\\(u([dD]([c-fC-F][0-9a-fA-F]?)?)?)?)?\Z")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
REPLACEMENT = "\ufffd"  # for a lone surrogate, which no UTF-8 text can hold


class JsonStringDecoder:
    """Decodes the body of one JSON string (its text after the opening quote).

    feed(text) returns the characters that text completes, holding back only an escape not yet
    whole (a `\\`, a `\\u12`, or a high surrogate's `\\uD83D` until its low half is known).
    `closed` is set at the closing quote, and `rest` holds the text fed after it. finish() says
    what is held when the text ends early: a lone high surrogate as U+FFFD; a cut escape is dropped.
    """

    def __init__(self) -> None:
        self.pending = ""
        self.closed = False
        self.rest = ""

    def feed(self, text: str) -> str:
        if self.closed:
            self.rest += text
            return ""
        s = self.pending + text
        out: list[str] = []
        i = 0
        while i < len(s):
            quote, backslash = s.find('"', i), s.find("\\", i)
            special = min(j for j in (quote, backslash, len(s)) if j >= 0)
            out.append(s[i:special])
            i = special
            if i == len(s):
                break
            if s[i] == '"':
                self.closed, self.rest, self.pending = True, s[i + 1 :], ""
                return "".join(out)
            decoded, used = self._escape(s, i)
            if used == 0:
                break  # incomplete: wait for more text
            out.append(decoded)
            i += used
        self.pending = s[i:]
        return "".join(out)

    def finish(self) -> str:
        held, self.pending = self.pending, ""
        return REPLACEMENT if held[:2] == "\\u" and len(held) >= 6 else ""

    @staticmethod
    def _escape(s: str, i: int) -> tuple[str, int]:
        """The escape at s[i] == '\\': (its text, characters used), or ("", 0) when incomplete."""
        if i + 1 >= len(s):
            return "", 0
        kind = s[i + 1]
        if kind != "u":
            return _SIMPLE_ESCAPES.get(kind, kind), 2
        if i + 6 > len(s):
            return "", 0
        if not _HEX4.fullmatch(s, i + 2, i + 6):
            return REPLACEMENT, 2  # not JSON; the grammars never write it
        code = int(s[i + 2 : i + 6], 16)
        if 0xDC00 <= code <= 0xDFFF:
            return REPLACEMENT, 6
        if not 0xD800 <= code <= 0xDBFF:
            return chr(code), 6
        # A high surrogate: one character with the low half that must follow.
        tail = s[i + 6 : i + 12]
        if len(tail) < 6 and _LOW_SURROGATE_PREFIX.match(tail):
            return "", 0
        if _LOW_SURROGATE.fullmatch(tail):
            low = int(tail[2:], 16)
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return REPLACEMENT, 6
