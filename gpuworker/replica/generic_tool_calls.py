"""`tool_choice: "auto"` on a model whose chat template does not render tools: the generic format
(llama.cpp's name for it). The model answers with exactly one JSON object, held to it by a grammar:

    {"tool_call": {"name": "<tool>", "arguments": {...}}}               one call
    {"tool_calls": [{"name": "<tool>", "arguments": {...}}, ...]}       several (parallel_tool_calls)
    {"response": "<the answer to the user>"}

so the choice between calling and answering is one early token in a well-formed object, which a
small model makes far more often than it opens a <tool_call> block in free text.
GenericToolParser turns that object, whole or streamed, into OpenAI content and tool calls: the
wrapper never reaches the client.
"""

from __future__ import annotations

import json
import re

from gpuworker.engine.structured_output import SCHEMA_DATA_KEYWORDS
from gpuworker.replica.json_string import JsonStringDecoder
from gpuworker.replica.tool_call_scanner import CallScanner, Malformed, ValueScanner, skip_ws
from gpuworker.replica.tool_calls import ParsedDelta, StreamingToolParser, ToolCall, tool_call_id

CALL_KEY, CALLS_KEY, RESPONSE_KEY = "tool_call", "tool_calls", "response"
TEXT_RESPONSE = {"type": "string"}


def _moved_refs(schema: object, root: str) -> object:
    """`schema` with its local references ("#...") pointed at its new place, definition `root`
    (its own definitions beside it as `root.<name>`)."""
    if isinstance(schema, list):
        return [_moved_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in SCHEMA_DATA_KEYWORDS else _moved_refs(value, root) for key, value in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for defs in ("#/$defs/", "#/definitions/"):
            if ref.startswith(defs):
                out["$ref"] = f"#/$defs/{root}.{ref[len(defs) :]}"
                break
        else:
            out["$ref"] = f"#/$defs/{root}{ref[1:]}"
    return out


def _as_definition(schema: object, root: str, definitions: dict) -> object:
    """A reference to `schema`, which goes into the answer schema's `definitions` as `root` (its
    own definitions beside it): nested in the answer's schema, its references ("#/$defs/Item", as
    Pydantic writes them) would otherwise point at the wrong root."""
    if not isinstance(schema, dict):
        return schema
    own = dict(schema)
    for defs in ("$defs", "definitions"):
        for name, definition in (own.pop(defs, None) or {}).items():
            definitions[f"{root}.{name}"] = _moved_refs(definition, root)
    definitions[root] = _moved_refs(own, root)
    return {"$ref": f"#/$defs/{root}"}


def _arguments_schema(function: dict, index: int, definitions: dict) -> object:
    parameters = function.get("parameters")
    if parameters is None or function.get("strict") is False:
        return {"type": "object"}  # any JSON object
    return _as_definition(parameters, f"tool{index}", definitions)


def generic_tool_schema(
    tools: list[dict], *, parallel_tool_calls: bool, response_schema: dict | bool | None = None
) -> dict:
    """The JSON schema of the answer: one call of an offered tool (its arguments following the
    tool's parameters schema), a list of one or more calls when parallel calls are allowed, or the
    response (a string, or `response_schema` when the request's response_format asks for JSON)."""
    definitions: dict = {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": _arguments_schema(tool["function"], i, definitions),
            },
            "required": ["name", "arguments"],
        }
        for i, tool in enumerate(tools)
    ]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    choices = [{"type": "object", "properties": {CALL_KEY: call}, "required": [CALL_KEY]}]
    if parallel_tool_calls:
        choices.append(
            {
                "type": "object",
                "properties": {CALLS_KEY: {"type": "array", "items": call, "minItems": 1}},
                "required": [CALLS_KEY],
            }
        )
    response = TEXT_RESPONSE if response_schema is None else _as_definition(response_schema, RESPONSE_KEY, definitions)
    choices.append({"type": "object", "properties": {RESPONSE_KEY: response}, "required": [RESPONSE_KEY]})
    return {"anyOf": choices, "$defs": definitions} if definitions else {"anyOf": choices}


def generic_tools_instruction(tools: list[dict], *, parallel_tool_calls: bool) -> str:
    """The system-prompt text: the tools, and the answer's format (the grammar's, shown by example)."""
    definitions = json.dumps(tools, indent=2, ensure_ascii=False)
    several = (
        f'\nTo call several tools at once: {{"{CALLS_KEY}": [<a call like the one above>, ...]}}'
        if parallel_tool_calls
        else ""
    )
    return (
        f"You can call any of the following tools to satisfy the user's requests: {definitions}\n\n"
        "Example tool call syntax:\n\n"
        f'{{\n  "{CALL_KEY}": {{\n    "name": "tool_name",\n'
        f'    "arguments": {{\n      "arg1": "some_value"\n    }}\n  }}\n}}\n'
        f"{several}\n"
        f"Respond in JSON format, either with `{CALL_KEY}` (a request to call tools) or with `{RESPONSE_KEY}` "
        "(your reply to the user's request)"
    )


def generic_calls_text(calls: list[dict]) -> str:
    """An assistant's earlier calls (template_message shape) as the generic format writes them."""
    written = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]} for call in calls]
    value = {CALL_KEY: written[0]} if len(written) == 1 else {CALLS_KEY: written}
    return json.dumps(value, ensure_ascii=False)


def generic_result_text(content: str) -> str:
    return json.dumps({"tool_response": content}, ensure_ascii=False)


# The object's opening and its first key, and text that may still grow into them.
_OPENING = re.compile(r'\s*\{\s*"([^"\\]*)"\s*:')
_OPENING_PREFIX = re.compile(r'\s*(\{\s*("[^"\\]*("\s*)?)?)?\Z')


class GenericToolParser(StreamingToolParser):
    """Splits a generic-format answer into content and tool calls, piece by piece, with
    ToolCallParser's interface: feed(text) and finish() return ParsedDelta; `calls` and `content`
    hold the whole. A response string is said decoded as it is written; a response that is JSON
    (response_format) is said as its JSON text. Text that is not the format (no grammar held it)
    is content as written."""

    def __init__(self) -> None:
        self.buffer = ""
        # opening -> response_value | string | value | call | list -> done; or text
        self.state = "opening"
        self.in_list = False
        self.string: JsonStringDecoder | None = None
        self.value: ValueScanner | None = None
        self.value_text = ""
        self.call: CallScanner | None = None
        self.current: ToolCall | None = None
        self.args_sent = 0
        self.calls: list[ToolCall] = []
        self.content = ""

    def _close(self, out: ParsedDelta) -> None:
        if self.state == "string":
            assert self.string is not None
            self._say(out, self.string.finish())
        elif self.state == "call":
            self._end_call(out)
        self.state = "done"

    def _say(self, out: ParsedDelta, text: str) -> None:
        out.content += text
        self.content += text

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        while self.buffer:
            state = self.state
            if state == "opening":
                match = _OPENING.match(self.buffer)
                if match is None:
                    if not final and _OPENING_PREFIX.match(self.buffer):
                        return  # may still be the opening
                    if not _OPENING_PREFIX.match(self.buffer):
                        self.state = "text"
                    else:
                        self.buffer = ""  # the output ended inside the wrapper: nothing to say
                    continue
                key = match.group(1)
                self.buffer = self.buffer[match.end() :]
                self.state = {RESPONSE_KEY: "response_value", CALL_KEY: "call", CALLS_KEY: "list"}.get(key, "text")
                if self.state == "text":  # another object: the text as written
                    self.buffer = match.group(0) + self.buffer
                elif self.state == "call":
                    self._start_call()
            elif state == "text":
                self._say(out, self.buffer)
                self.buffer = ""
            elif state == "response_value":
                i = skip_ws(self.buffer, 0)
                self.buffer = self.buffer[i:]
                if not self.buffer:
                    return
                if self.buffer[0] == '"':
                    self.string, self.state = JsonStringDecoder(), "string"
                    self.buffer = self.buffer[1:]
                else:
                    self.value, self.value_text, self.state = ValueScanner(), "", "value"
            elif state == "string":
                assert self.string is not None
                text, self.buffer = self.buffer, ""
                self._say(out, self.string.feed(text))
                if not self.string.closed:
                    return
                self.state = "done"
            elif state == "value":
                self._read_value(out)
            elif state == "call":
                self._read_call(out)
                if self.state == "call":
                    return
            elif state == "list":
                if not self._read_list():
                    return
            else:  # done: the object's closing brackets
                self.buffer = ""

    def _read_value(self, out: ParsedDelta) -> None:
        assert self.value is not None
        said = len(self.value_text)
        self.value_text += self.buffer
        self.buffer = ""
        try:
            end = self.value.scan(self.value_text)
        except Malformed:
            end = len(self.value_text)
        stop = len(self.value_text) if end is None else end
        self._say(out, self.value_text[said:stop])
        if end is not None:
            self.state = "done"

    def _read_list(self) -> bool:
        """Between calls in a tool_calls list: `[`, `,` or `]`. False to wait for more text."""
        i = skip_ws(self.buffer, 0)
        if i >= len(self.buffer):
            self.buffer = ""
            return False
        c = self.buffer[i]
        self.buffer = self.buffer[i + 1 :]
        if c == "[" and not self.in_list or c == "," and self.in_list:
            self.in_list = True
            self._start_call()
            self.state = "call"
        else:  # "]" (or anything the grammar never writes): no more calls
            self.state = "done"
        return True

    def _start_call(self) -> None:
        self.call, self.current, self.args_sent = CallScanner(("arguments",)), None, 0

    def _read_call(self, out: ParsedDelta) -> None:
        call = self.call
        assert call is not None
        text, self.buffer = self.buffer, ""
        call.feed(text)
        if self.current is None and call.name is not None:
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
            stop = call.args_end if call.args_end is not None else len(call.text)
            fragment = call.text[call.args_start + self.args_sent : stop]
            self.args_sent += len(fragment)
            if fragment:
                self.current.arguments += fragment
                out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})
        if call.end is not None or call.malformed:
            rest = call.text[call.end :] if call.end is not None else ""
            self._end_call(out)
            self.buffer = rest
            self.state = "list" if self.in_list and not call.malformed else "done"

    def _end_call(self, out: ParsedDelta) -> None:
        if self.current is not None and not self.current.arguments:
            self.current.arguments = "{}"
            out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": "{}"}})
        self.call, self.current = None, None
