"""The generic format of tool_choice "auto" on templates without tools: its grammar (one JSON
object, a call of an offered tool or the response), and the parser that turns the object, whole or
streamed, into OpenAI content and tool calls without any of the wrapper."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from xgrammar.testing import _is_grammar_accept_string

from gpuworker.contract.openai_api import ChatCompletionRequest, parse_request
from gpuworker.replica.generic_tool_calls import GenericToolParser, generic_calls_text, generic_tools_instruction
from gpuworker.replica.response_format import generic_tools_constraint
from tests.gpuworker.replica.test_tool_calls import TOOLS

ONE = '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}'
TWO = (
    '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]}'
)
ANSWER = '{"response": "It is \\"sunny\\"\\nin Oslo \\u2600\\ufe0f \\ud83d\\ude00"}'


def _grammar(**body) -> xgr.Grammar:
    request = parse_request(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body}
    )
    return xgr.Grammar.from_structural_tag(generic_tools_constraint(request).spec)


def test_the_grammar_admits_one_call_or_the_response_and_nothing_else():
    grammar = _grammar()
    accepts = lambda text: _is_grammar_accept_string(grammar, text)  # noqa: E731
    assert accepts(ONE) and accepts(TWO) and accepts(ANSWER)
    assert accepts('{\n"tool_call": {\n"name": "add",\n"arguments": {\n"a": 1,\n"b": 2\n}\n}\n}')  # one blank
    assert not accepts('{"tool_call":  {"name": "add", "arguments": {"a": 1, "b": 2}}}')  # but no more
    assert not accepts("It is sunny.")  # no free text
    assert not accepts(ONE + " ok") and not accepts(ANSWER + ANSWER)
    assert not accepts('{"tool_call": {"name": "delete", "arguments": {}}}')  # only offered tools
    assert not accepts('{"tool_call": {"name": "add", "arguments": {"a": "one", "b": 2}}}')  # the tool's schema
    assert not accepts('{"tool_call": {"name": "add", "arguments": {"a": 1}}}')
    assert not accepts('{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}}')
    assert not accepts('{"tool_calls": []}')  # a list holds at least one call
    assert not accepts('{"response": 12}') and not accepts('{"response": "a", "tool_call": null}')


def test_without_parallel_calls_the_list_is_not_admitted():
    grammar = _grammar(parallel_tool_calls=False)
    assert _is_grammar_accept_string(grammar, ONE) and _is_grammar_accept_string(grammar, ANSWER)
    assert not _is_grammar_accept_string(grammar, TWO)


def test_with_response_format_the_response_is_that_json():
    grammar = _grammar(
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "w",
                "schema": {"type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"]},
            },
        }
    )
    assert _is_grammar_accept_string(grammar, '{"response": {"sky": "clear"}}')
    assert _is_grammar_accept_string(grammar, ONE)
    assert not _is_grammar_accept_string(grammar, ANSWER)
    parsed = _parse('{"response": {"sky": "clear"}}')
    assert parsed.content == '{"sky": "clear"}' and not parsed.calls


class Item(BaseModel):
    sku: str
    count: int


class Order(BaseModel):
    """Pydantic writes the nested model as "$defs" with "#/$defs/Item" references."""

    items: list[Item]
    gift: Item | None = None


def test_schemas_with_definitions_keep_their_references():
    # Nested in the answer's schema, "#/$defs/Item" would point at the answer's root.
    order = Order.model_json_schema()
    assert "$defs" in order
    tool = {"type": "function", "function": {"name": "place_order", "parameters": order}}
    body = {
        "tools": [tool, *TOOLS],
        "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": order}},
    }
    grammar = _grammar(**body)
    good = '{"items": [{"sku": "a1", "count": 2}], "gift": {"sku": "b", "count": 1}}'
    bad = '{"items": [{"sku": "a1", "count": "two"}]}'
    for wrap in ('{{"tool_call": {{"name": "place_order", "arguments": {}}}}}', '{{"response": {}}}'):
        assert _is_grammar_accept_string(grammar, wrap.format(good))
        assert not _is_grammar_accept_string(grammar, wrap.format(bad))
    assert _is_grammar_accept_string(grammar, ONE)


def test_the_instruction_shows_the_tools_and_the_grammar_keys():
    text = generic_tools_instruction(TOOLS, parallel_tool_calls=True)
    assert json.dumps(TOOLS, indent=2) in text
    assert '"tool_call"' in text and '"tool_calls"' in text and "`response`" in text
    assert '"tool_calls"' not in generic_tools_instruction(TOOLS, parallel_tool_calls=False)


def _parse(text: str) -> GenericToolParser:
    parser = GenericToolParser()
    parser.feed(text)
    parser.finish()
    return parser


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (ONE, "", [("add", {"a": 1, "b": 2})]),
        (TWO, "", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
        (
            '{\n"tool_call": {\n"name": "add",\n"arguments": {\n"a": 1,\n"b": 2\n}\n}\n}',
            "",
            [("add", {"a": 1, "b": 2})],
        ),
        (ANSWER, 'It is "sunny"\nin Oslo ☀️ 😀', []),
        ('{ "response" : "" }', "", []),
        # Cut short (finish_reason "length"): what was written, never the wrapper.
        ('{"response": "It is su', "It is su", []),
        ('{"response": "x\\u26', "x", []),
        ('{"tool_c', "", []),
        ('{"tool_call": {"name": "add", "arguments": {"a": 1', "", [("add", '{"a": 1')]),
        ('{"tool_call": {"name": "add"', "", [("add", {})]),
        # Not the format (no grammar held the output): the text as written.
        ("Hello there", "Hello there", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
)
def test_whole_outputs(text, content, calls):
    parser = _parse(text)
    assert parser.content == content and len(parser.calls) == len(calls)
    assert [
        (c.name, c.arguments if isinstance(want, str) else json.loads(c.arguments))
        for c, (_, want) in zip(parser.calls, calls)
    ] == calls


def _stream(text: str, cuts: list[int]) -> tuple[str, dict[int, dict]]:
    parser = GenericToolParser()
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    content, calls = "", {}
    for said in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content += said.content
        for delta in said.tool_calls:
            call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
            if "id" in delta:
                assert call["name"] is None and delta["function"]["arguments"] == ""
                call["name"] = delta["function"]["name"]
            call["arguments"] += delta["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("text", [ONE, TWO, ANSWER, '{"response": "abc\\ud83d', '{"tool_calls": [{"name": "add"'])
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=40))
def test_streamed_pieces_add_up_to_the_whole_output(text, cuts):
    whole = _parse(text)
    content, calls = _stream(text, cuts)
    assert content == whole.content
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (c.name, c.arguments) for c in whole.calls
    ]


def test_content_and_arguments_stream_as_they_are_written():
    parser = GenericToolParser()
    said = [parser.feed(ch) for ch in ANSWER] + [parser.finish()]
    pieces = [s.content for s in said if s.content]
    assert len(pieces) > 20 and "".join(pieces) == json.loads(ANSWER)["response"]
    assert not any("{" in p or '"response"' in p or "\\" in p for p in pieces)
    parser = GenericToolParser()
    said = [parser.feed(ch) for ch in ONE] + [parser.finish()]
    first = next(i for i, s in enumerate(said) if s.tool_calls)
    assert said[first].tool_calls[0]["function"]["name"] == "add" and ONE[: first + 1].endswith('"add"')
    fragments = [d["function"]["arguments"] for s in said for d in s.tool_calls if "id" not in d]
    assert len(fragments) > 5 and json.loads("".join(fragments)) == {"a": 1, "b": 2}


def test_earlier_calls_are_written_as_the_grammar_writes_them():
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert json.loads(generic_calls_text(calls)) == json.loads(ONE)
    two = calls + [
        {
            "id": "c2",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
        }
    ]
    assert json.loads(generic_calls_text(two)) == json.loads(TWO)
    assert _is_grammar_accept_string(_grammar(), generic_calls_text(two))
    assert [c.name for c in _parse(generic_calls_text(two)).calls] == ["add", "get_weather"]
