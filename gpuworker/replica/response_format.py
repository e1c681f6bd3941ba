"""OpenAI's response_format and forced tool calls as engine constraints (StructuredOutput), with
their schemas checked first so that a schema the grammar engine cannot use is a 400 naming the
field, not an engine error.

Only the worker imports this module (xgrammar loads torch; the gateway does not need either).
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag

from gpuworker.contract.openai_api import ChatCompletionRequest, NamedToolChoice, ProtocolError, ResponseFormat
from gpuworker.engine.structured_output import (
    JSON_MAX_WHITESPACE,
    SCHEMA_DATA_KEYWORDS,
    StructuredOutput,
    xgrammar_reason,
)
from gpuworker.replica.generic_tool_calls import generic_tool_schema
from gpuworker.replica.tool_calls import ToolCallFormat, forced_tool_grammar

_XGRAMMAR_ERRORS = (RuntimeError, ValueError, TypeError)


def check_json_schema(schema: dict, param: str) -> None:
    """Raise ProtocolError(param) when xgrammar cannot turn `schema` into a grammar."""
    try:
        xgr.Grammar.from_json_schema(json.dumps(schema))
    except _XGRAMMAR_ERRORS as exc:
        raise ProtocolError(
            f"{param}: this JSON schema is not supported: {xgrammar_reason(exc)}", param=param
        ) from None


def grammar_schema(schema: Any) -> Any:
    """A copy of `schema` for the grammar, working around xgrammar 0.2's length-limited strings.

    xgrammar writes a string with minLength/maxLength (and no pattern) as any characters but
    quote, backslash and newlines, so control characters slip in unescaped and the output is not
    JSON. The copy gives such strings a pattern of the same lengths over the characters JSON
    allows unescaped; the request's own schema is unchanged.
    """
    if isinstance(schema, list):
        return [grammar_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    copy = {key: value if key in SCHEMA_DATA_KEYWORDS else grammar_schema(value) for key, value in schema.items()}
    limited = "minLength" in copy or "maxLength" in copy
    if copy.get("type") == "string" and limited and not {"pattern", "format", "enum", "const"} & copy.keys():
        low = copy.pop("minLength", 0)
        high = copy.pop("maxLength", "")
        # Regex: none of quote, backslash, U+0000 to U+001F, or UTF-16 surrogates (which xgrammar
        # would otherwise write as invalid UTF-8); between low and high of them.
        copy["pattern"] = r'^[^"\\\u0000-\u001f\ud800-\udfff]' + f"{{{low},{high}}}$"
    return copy


def json_constraint(schema: dict | bool) -> StructuredOutput:
    """JSON valid against `schema`, with runs of whitespace between tokens capped.

    Plain JSON grammars allow unbounded whitespace, and a model that falls into writing blanks
    (a weak or random one does) never finishes; the cap (JSON_MAX_WHITESPACE) is one blank.
    xgrammar's structural tag carries that cap, so the constraint is a one-part structural tag.
    The schema stays in its declared property order, which is the order the output follows.
    """
    tag = StructuralTag(
        format=JSONSchemaFormat(json_schema=grammar_schema(schema), max_whitespace_cnt=JSON_MAX_WHITESPACE)
    )
    return StructuredOutput.structural_tag(tag.model_dump_json())


def response_format_schema(response_format: ResponseFormat | None) -> dict | bool | None:
    """The JSON schema a response_format asks for (checked), None for text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    assert response_format.json_schema is not None  # ResponseFormat's own check
    schema = response_format.json_schema.schema_
    check_json_schema(schema, "response_format.json_schema.schema")
    return schema


def response_format_constraint(response_format: ResponseFormat | None) -> StructuredOutput | None:
    schema = response_format_schema(response_format)
    return None if schema is None else json_constraint(schema)


def checked_tools(request: ChatCompletionRequest) -> list[dict]:
    """The request's tools as dicts, each parameters schema checked (ProtocolError naming it)."""
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
    for i, tool in enumerate(tools):
        if "parameters" in tool["function"]:
            check_json_schema(tool["function"]["parameters"], f"tools.{i}.function.parameters")
    return tools


def tool_choice_constraint(request: ChatCompletionRequest, fmt: ToolCallFormat) -> StructuredOutput | None:
    """The grammar of a forced call (tool_choice 'required' or a named function); None for 'auto'.
    Every tool's parameters schema is checked, whatever the choice: a call to any of them parses."""
    tools = checked_tools(request)
    if not request.forces_tool_call:
        return None
    choice = request.effective_tool_choice
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    for tool in tools:
        if "parameters" in tool["function"]:
            tool["function"]["parameters"] = grammar_schema(tool["function"]["parameters"])
    return _tool_grammar(
        forced_tool_grammar(
            fmt,
            tools,
            function_name=name,
            parallel_tool_calls=request.parallel_tool_calls,
            max_whitespace=JSON_MAX_WHITESPACE,
        )
    )


def generic_tools_constraint(request: ChatCompletionRequest) -> StructuredOutput:
    """The grammar of tool_choice "auto" in the generic format (generic_tool_calls): one JSON
    object, a call of an offered tool or the response (text, or the JSON of response_format)."""
    schema = generic_tool_schema(
        checked_tools(request),
        parallel_tool_calls=request.parallel_tool_calls,
        response_schema=response_format_schema(request.response_format),
    )
    return _tool_grammar(json_constraint(schema).spec)


def _tool_grammar(spec: str) -> StructuredOutput:
    """A structural tag that admits tool calls, built once here so that a failure is a 400 naming `tools`."""
    try:
        xgr.Grammar.from_structural_tag(spec)
    except _XGRAMMAR_ERRORS as exc:
        raise ProtocolError(
            f"tools: the tool-call grammar could not be built: {xgrammar_reason(exc)}", param="tools"
        ) from None
    return StructuredOutput.structural_tag(spec)
