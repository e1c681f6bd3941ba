"""Tool calls in model output, per model family: which format a model writes, the grammar that
forces a well-formed call, and the parser that turns output text (whole or streamed) into calls.

Formats (the ones our model families are trained on):
  hermes       Qwen 2/2.5/3 and others:  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
  llama3_json  Llama 3.1/3.2/3.3:        {"name": "f", "parameters": {...}}

One incremental parser serves both the streaming and the whole response, so a streamed reply
adds up to exactly the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpuworker.replica.tool_call_scanner import CallScanner, skip_ws


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    # What opens a call in free text, as a regex; `trigger_prefix` matches any text that could
    # still grow into a trigger (held back from content while streaming).
    trigger: re.Pattern
    trigger_prefix: re.Pattern
    # Whether the call's JSON object begins with the trigger's own text (llama) or after it (hermes).
    object_in_trigger: bool
    close: str  # what follows the JSON object ("" for none)
    argument_keys: tuple[str, ...]
    # Between two calls: what the grammar writes and what the parser skips.
    separator: str
    # The structural-tag pieces around a call's arguments.
    tag_begin: str  # + name + tag_middle
    tag_middle: str
    tag_end: str


HERMES = ToolCallFormat(
    name="hermes",
    trigger=re.compile(r"<tool_call>"),
    trigger_prefix=re.compile(r"<(t(o(o(l(_(c(a(l(l)?)?)?)?)?)?)?)?)?\Z"),
    object_in_trigger=False,
    close="</tool_call>",
    argument_keys=("arguments", "parameters"),
    separator="\n",
    tag_begin='<tool_call>\n{"name": "',
    tag_middle='", "arguments": ',
    tag_end="}\n</tool_call>",
)

LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    trigger=re.compile(r'\{\s*"name"'),
    trigger_prefix=re.compile(r'\{\s*("(n(a(m(e)?)?)?)?)?\Z'),
    object_in_trigger=True,
    close="",
    argument_keys=("parameters", "arguments"),
    separator="; ",
    tag_begin='{"name": "',
    tag_middle='", "parameters": ',
    tag_end="}",
)

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def detect_tool_format(chat_template: str | None, model_type: str = "") -> ToolCallFormat | None:
    """The tool-call format a model writes, read from its chat template (which teaches it the format).

    None when the template does not render tools at all: the tools then go into the prompt
    (gpuworker.replica.tool_prompt). Raises ValueError (naming `tools`) when it renders them in a
    format this server cannot parse.
    """
    template = chat_template or ""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if '"parameters"' in template and ("<|start_header_id|>" in template or model_type == "llama"):
        return LLAMA3_JSON
    raise ValueError(
        f"tools: this model's chat template uses a tool-call format the server does not "
        f"support (supported: {', '.join(FORMATS)})"
    )


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the grammar of forced calls -------------------------------------------------------------------


def forced_tool_grammar(
    fmt: ToolCallFormat,
    tools: list[dict],
    *,
    function_name: str | None,
    parallel_tool_calls: bool,
    max_whitespace: int | None = None,
) -> str:
    """An xgrammar structural tag (JSON text) that admits only tool calls in `fmt`: exactly one call
    of `function_name`, or (function_name None, tool_choice "required") one or more calls of any
    tool, or exactly one when parallel calls are off. Arguments follow each function's parameters
    schema (with runs of whitespace capped at `max_whitespace`); nothing else may be written, so
    the output always parses."""
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat

    def tag(function: dict) -> TagFormat:
        schema = function.get("parameters")
        if schema is None or function.get("strict") is False:
            schema = {"type": "object"}  # any JSON object
        return TagFormat(
            begin=fmt.tag_begin + function["name"] + fmt.tag_middle,
            content=JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=max_whitespace),
            end=fmt.tag_end,
        )

    functions = [tool["function"] for tool in tools]
    if function_name is not None:
        structure: Any = tag(next(f for f in functions if f["name"] == function_name))
    else:
        structure = TagsWithSeparatorFormat(
            tags=[tag(f) for f in functions],
            separator=fmt.separator,
            at_least_one=True,
            stop_after_first=not parallel_tool_calls,
        )
    return StructuralTag(format=structure).model_dump_json()


# -- parsing ---------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    """What one piece of output adds: content text, and tool-call deltas in OpenAI's streaming
    shape (the first for a call carries id, type and name; later ones argument fragments)."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


class StreamingToolParser:
    """What the tool-call parsers share: the model's text arrives in pieces (feed), then its end
    (finish), and each returns what can be said so far; `content` and `calls` hold the whole. A
    parser reads `buffer` in _advance and says what is left at the end in _close."""

    buffer: str
    content: str
    calls: list[ToolCall]

    def whole(self, text: str) -> ParsedOutput:
        """A whole output's content (None when empty) and tool calls: the same as streaming it."""
        self.feed(text)
        self.finish()
        return ParsedOutput(self.content or None, self.calls)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self.buffer += text
        self._advance(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._advance(out, final=True)
        self._close(out)
        return out

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        raise NotImplementedError

    def _close(self, out: ParsedDelta) -> None:
        raise NotImplementedError


class ToolCallParser(StreamingToolParser):
    """Splits a choice's output into content and tool calls, piece by piece.

    feed(text) returns what can be said for sure so far: content that cannot be the start of a
    call, a call's name once it is known to be a call, its arguments as they are written.
    finish() flushes what was held back. Content is trimmed of surrounding whitespace (the lines
    around calls). A call must name one of `tool_names` (when given) and, in formats without a
    close marker, carry arguments: otherwise its text is content (a JSON object in prose is not a
    call).
    """

    def __init__(self, fmt: ToolCallFormat, tool_names: set[str] | frozenset[str] | None = None) -> None:
        self.fmt = fmt
        self.tool_names = tool_names
        self.buffer = ""  # unread text
        self.call: CallScanner | None = None  # the call object being read
        self.call_raw = ""  # its text from the trigger, to give back as content if it is none
        self.current: ToolCall | None = None  # the call once announced
        self.calls: list[ToolCall] = []
        self.args_sent = 0  # of the current call's argument text
        self.content_started = False
        self.held_space = ""  # trailing whitespace of content, said only if more content follows
        self.closing = False  # after a call's object: reading its close marker / separator
        self.skipping = False  # in a malformed call's text, up to its close marker
        self.content = ""  # everything said as content, for the whole response

    # -- content --

    def _say(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        if not self.content_started:
            text = text.lstrip()
            if not text:
                return
            self.content_started = True
        stripped = text.rstrip()
        if stripped:
            out.content += self.held_space + stripped
            self.content += self.held_space + stripped
            self.held_space = text[len(stripped) :]
        else:
            self.held_space += text

    # -- the step --

    def _close(self, out: ParsedDelta) -> None:
        if self.call is not None:
            self._end_call(out)
        elif self.buffer:
            self._say(out, self.buffer)
            self.buffer = ""

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        while self.buffer:
            if self.skipping:
                if not self._skip_broken_call(final):
                    return
                continue
            if self.closing:
                if not self._read_close(final):
                    return
                continue
            if self.call is None:
                match = self.fmt.trigger.search(self.buffer)
                if match is None:
                    hold = self.fmt.trigger_prefix.search(self.buffer)
                    if final and hold is not None and self.calls:
                        # Cut (max_tokens) inside the marker of a call after calls: markup, dropped.
                        self._say(out, self.buffer[: hold.start()])
                        self.buffer = ""
                        return
                    cut = len(self.buffer) if final or hold is None else hold.start()
                    self._say(out, self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    return
                self._say(out, self.buffer[: match.start()])
                start = match.start() if self.fmt.object_in_trigger else match.end()
                self.call_raw = self.buffer[match.start() : start]
                self.buffer = self.buffer[start:]
                self.call = CallScanner(self.fmt.argument_keys)
                self.args_sent = 0
                continue
            self._read_call(out)
            if self.call is not None:
                return

    def _not_a_call(self, out: ParsedDelta, rest: str = "") -> None:
        """The text taken for a call is none: say it as content and read on after it."""
        raw = self.call_raw[: len(self.call_raw) - len(rest)]
        # The trigger's first character is content; the text after it is read again (it may
        # hold a real call).
        self._say(out, raw[:1])
        self.buffer = raw[1:] + rest
        self.call, self.call_raw = None, ""

    def _read_call(self, out: ParsedDelta) -> None:
        call = self.call
        assert call is not None
        text, self.buffer = self.buffer, ""
        self.call_raw += text
        call.feed(text)
        rest = call.text[call.end :] if call.end is not None else ""
        if self.current is None and call.name is not None:
            if self.tool_names is not None and call.name not in self.tool_names:
                self._not_a_call(out, rest)
                return
            if call.args_start is None and not self.fmt.close:
                # Without markers around calls, an object is known to be a call once its
                # arguments begin.
                if call.end is not None or call.malformed:
                    self._not_a_call(out, rest)
                return
            self.current = ToolCall(tool_call_id(), call.name)
            self.calls.append(self.current)
            out.tool_calls.append(
                {
                    "index": len(self.calls) - 1,
                    "id": self.current.id,
                    "type": "function",
                    "function": {"name": self.current.name, "arguments": ""},
                }
            )
        if self.current is not None and call.args_start is not None:
            self._send_args(out, self.current, call)
        if call.malformed:
            if self.current is None:
                self._not_a_call(out)
            else:  # already announced: close it as it stands; its other text is dropped
                after = call.text[call.args_end :] if call.args_end is not None else ""
                self._end_call(out)
                self.buffer, self.skipping = after, True
            return
        if call.end is not None:
            if self.current is None:  # an object without a name
                self._not_a_call(out, rest)
                return
            self._end_call(out)
            self.buffer = rest
            self.closing = True

    def _send_args(self, out: ParsedDelta, current: ToolCall, call: CallScanner) -> None:
        start, end = call.args_start, call.args_end
        if call.text[start : start + 1] == '"':
            # Arguments written as a JSON string holding JSON: said once, decoded, when complete.
            if end is None or current.arguments:
                return
            try:
                fragment = json.loads(call.text[start:end])
            except ValueError:
                fragment = call.text[start:end]
        else:
            stop = end if end is not None else len(call.text)
            fragment = call.text[start + self.args_sent : stop]
            self.args_sent += len(fragment)
        if fragment:
            current.arguments += fragment
            out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})

    def _end_call(self, out: ParsedDelta) -> None:
        if self.current is None:  # the output ended inside what never became a call:
            if not self.calls:  # text, unless calls came before it (then the next call, cut)
                self._say(out, self.call_raw)
        elif not self.current.arguments:
            self.current.arguments = "{}"
            out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": "{}"}})
        self.call, self.current, self.call_raw = None, None, ""

    def _skip_broken_call(self, final: bool) -> bool:
        """Drop a malformed call's text up to its close marker (to the end if the format has none)."""
        close = self.fmt.close
        at = self.buffer.find(close) if close else -1
        if at < 0:
            keep = 0 if final or not close else len(close) - 1
            self.buffer = self.buffer[len(self.buffer) - keep :] if keep else ""
            if final:
                self.buffer = ""
            return False
        self.buffer = self.buffer[at + len(close) :]
        self.skipping, self.closing = False, True
        return True

    def _read_close(self, final: bool) -> bool:
        """Consume whitespace, the close marker and a separator after a call; False to wait for more."""
        text = self.buffer
        i = skip_ws(text, 0)
        for piece in (self.fmt.close, self.fmt.separator.strip()):
            if not piece:
                continue
            if text.startswith(piece, i):
                i = skip_ws(text, i + len(piece))
            elif piece.startswith(text[i:]):
                if not final:
                    return False  # could still become it
                i = len(text)  # the output was cut inside it (max_tokens): markup, dropped
        if i >= len(text) and not final:
            self.buffer = ""
            return False
        self.buffer = text[i:]
        self.closing = False
        return True


def parse_tool_calls(fmt: ToolCallFormat, text: str, tool_names: set[str] | None = None) -> ParsedOutput:
    """A whole output's content and tool calls (the same as streaming it through ToolCallParser)."""
    return ToolCallParser(fmt, tool_names).whole(text)
