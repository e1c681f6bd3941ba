"""Tool-call formats: detection from chat templates, the grammar of forced calls, and parsing of
whole and streamed output (which must agree exactly)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string

from gpuworker.contract.openai_api import ChatCompletionRequest, parse_request
from gpuworker.demo_model import CHAT_TEMPLATE as DEMO_TEMPLATE
from gpuworker.replica.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ToolCallParser,
    detect_tool_format,
    forced_tool_grammar,
    parse_tool_calls,
)
from tests.gpuworker.replica.tool_templates import LLAMA3_1_CHAT_TEMPLATE, QWEN2_5_CHAT_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
NAMES = {"get_weather", "add"}


def call_text(fmt, name: str, arguments: dict) -> str:
    return fmt.tag_begin + name + fmt.tag_middle + json.dumps(arguments) + fmt.tag_end


# -- detection --------------------------------------------------------------------------------------


def test_the_format_is_read_from_the_chat_template():
    assert detect_tool_format(QWEN2_5_CHAT_TEMPLATE, "qwen2") is HERMES
    assert detect_tool_format(LLAMA3_1_CHAT_TEMPLATE, "llama") is LLAMA3_JSON
    # None: the template cannot show tools, the prompt fallback (tool_prompt) takes over.
    assert detect_tool_format(DEMO_TEMPLATE, "llama") is None
    assert detect_tool_format(None, "llama") is None
    with pytest.raises(ValueError, match="not support"):  # Mistral's [TOOL_CALLS] style
        detect_tool_format("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}", "mistral")


# -- parsing whole outputs --------------------------------------------------------------------------


def test_hermes_output_with_text_and_two_calls():
    text = (
        "Let me look that up.\n"
        + call_text(HERMES, "get_weather", {"city": "Paris", "unit": "celsius"})
        + "\n"
        + call_text(HERMES, "add", {"a": 1, "b": 2})
    )
    parsed = parse_tool_calls(HERMES, text, NAMES)
    assert parsed.content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert parsed.tool_calls[0].to_dict()["type"] == "function"


@pytest.mark.parametrize(
    "text, content, calls",
    [
        # arguments before the name, nested braces and a brace inside a string
        (
            '<tool_call>\n{"arguments": {"q": "}{", "n": [1, {"x": 2}]}, "name": "add"}\n</tool_call>',
            None,
            [("add", '{"q": "}{", "n": [1, {"x": 2}]}')],
        ),
        # arguments as a JSON string holding JSON (some fine-tunes write that)
        ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("add", '{"a": 1}')]),
        # no arguments at all
        ('<tool_call>\n{"name": "add"}\n</tool_call> done', "done", [("add", "{}")]),
        # not JSON inside the markers: text, as written
        ("<tool_call>\nnot json</tool_call> x", "<tool_call>\nnot json</tool_call> x", []),
        # a function the request did not offer: text
        (
            '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
            '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
            [],
        ),
        # things that look like the start of a marker, but are not
        ("a < b and <tool or <tool_", "a < b and <tool or <tool_", []),
        # cut off inside the arguments (finish_reason length): the call as far as it got
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1', None, [("add", '{"a": 1')]),
        # cut off before the name is complete: text
        ('Sure <tool_call>\n{"name": "ad', 'Sure <tool_call>\n{"name": "ad', []),
        # a model repeating its call until max_tokens, cut inside the close marker, the next trigger or
        # the next call's name: after a call, the cut markup is dropped, never content
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_ca', None, [("add", '{"a": 1}')]),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_c', None, [("add", '{"a": 1}')]),
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "ad',
            None,
            [("add", '{"a": 1}')],
        ),
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "add", '
            '"arguments": {"a": 1}}\n</tool_call',
            None,
            [("add", '{"a": 1}'), ("add", '{"a": 1}')],
        ),
    ],
)
def test_hermes_edge_cases(text, content, calls):
    parsed = parse_tool_calls(HERMES, text, NAMES)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "add", "parameters": {"a": 5, "b": 6}}', None, [("add", '{"a": 5, "b": 6}')]),
        (
            '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
            None,
            [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Oslo"}')],
        ),
        # JSON in prose with a "name" is not a call: no parameters, or not a tool's name
        ('Here: {"name": "Bob", "age": 3}.', 'Here: {"name": "Bob", "age": 3}.', []),
        ('{"name": "add", "age": 3}', '{"name": "add", "age": 3}', []),
        ('a {b} then {"name": "add", "parameters": {"a": 1, "b": 1}} c', "a {b} then c", [("add", '{"a": 1, "b": 1}')]),
        # "arguments" is accepted as well as Llama's "parameters"
        ('{"name": "add", "arguments": {"a": 1, "b": 1}}', None, [("add", '{"a": 1, "b": 1}')]),
        # broken after the arguments: the call stands, the broken rest is dropped
        ('{"name": "add", "parameters": {"a": 1, "b": 2}, "x": }', None, [("add", '{"a": 1, "b": 2}')]),
    ],
)
def test_llama3_json_cases(text, content, calls):
    parsed = parse_tool_calls(LLAMA3_JSON, text, NAMES)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


# -- streaming ----------------------------------------------------------------------------------------


def stream(fmt, text: str, cuts: list[int]):
    """Feed text in pieces cut at `cuts`; returns (content, calls by index, deltas)."""
    parser = ToolCallParser(fmt, NAMES)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    said = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    content, calls, deltas = "", {}, []
    for piece in said:
        content += piece.content
        for delta in piece.tool_calls:
            deltas.append(delta)
            call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in delta:
                assert call["id"] is None, "a call is announced once"
                assert delta["type"] == "function" and delta["function"]["arguments"] == ""
                call["id"], call["name"] = delta["id"], delta["function"]["name"]
            else:
                assert call["id"] is not None, "arguments come after the call's announcement"
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            call["arguments"] += delta["function"]["arguments"]
    return content, calls, deltas


STREAM_CASES = [
    (
        HERMES,
        "Checking.\n"
        + call_text(HERMES, "get_weather", {"city": 'Rio "de" {Janeiro}', "unit": "celsius"})
        + "\n"
        + call_text(HERMES, "add", {"a": -1, "b": 20}),
    ),
    (HERMES, "just text, with a < and a <tool in it\n\n  "),
    (HERMES, '<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call> and after'),
    (HERMES, "<tool_call>\nbroken</tool_call> then " + call_text(HERMES, "add", {"a": 3, "b": 4})),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 12'),
    (HERMES, call_text(HERMES, "add", {"a": 1, "b": 2}) + "\n" + call_text(HERMES, "add", {"a": 1, "b": 2})[:-3]),
    (HERMES, call_text(HERMES, "add", {"a": 1, "b": 2}) + '\n<tool_call>\n{"name": "ad'),
    (
        LLAMA3_JSON,
        call_text(LLAMA3_JSON, "add", {"a": 1, "b": 2}) + "; " + call_text(LLAMA3_JSON, "add", {"a": 3, "b": 4}),
    ),
    (LLAMA3_JSON, 'Data {"name": "Bob"} and {"k": 1} { "name": "add", "parameters": {"a": 1, "b": 0}}'),
    (LLAMA3_JSON, '{"name": "add", "parameters": 12}'),
]


@pytest.mark.parametrize("fmt, text", STREAM_CASES)
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=40))
def test_streamed_pieces_add_up_to_the_whole_output(fmt, text, cuts):
    whole = parse_tool_calls(fmt, text, NAMES)
    content, calls, _ = stream(fmt, text, cuts)
    assert content == (whole.content or "")
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]


def test_arguments_stream_as_they_are_written_and_markup_never_reaches_content():
    text = "Sure. " + call_text(HERMES, "get_weather", {"city": "Paris", "unit": "celsius"})
    parser = ToolCallParser(HERMES, NAMES)
    said = [parser.feed(ch) for ch in text] + [parser.finish()]
    content = "".join(s.content for s in said)
    assert content == "Sure." and "<" not in content
    fragments = [d["function"]["arguments"] for s in said for d in s.tool_calls if "id" not in d]
    assert len(fragments) > 10  # one per character once the arguments began, not one lump at the end
    assert json.loads("".join(fragments)) == {"city": "Paris", "unit": "celsius"}
    # The name is announced as soon as it is complete, before any argument.
    first = next(i for i, s in enumerate(said) if s.tool_calls)
    assert said[first].tool_calls[0]["function"]["name"] == "get_weather"
    assert text[: first + 1].endswith('"get_weather"')


# -- the grammar of forced calls ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_forced_grammar_admits_only_well_formed_calls_of_the_offered_tools(fmt):
    one = call_text(fmt, "add", {"a": 1, "b": 2})
    two = one + fmt.separator + call_text(fmt, "get_weather", {"city": "Oslo", "unit": "celsius"})

    def accepts(spec: str, text: str) -> bool:
        return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(spec), text)

    required = forced_tool_grammar(fmt, TOOLS, function_name=None, parallel_tool_calls=True)
    assert accepts(required, one) and accepts(required, two)
    assert not accepts(required, "")  # at least one call
    assert not accepts(required, "Sure. " + one)  # no text around calls
    assert not accepts(required, one + " ok")
    assert not accepts(required, call_text(fmt, "add", {"a": "one", "b": 2}))  # arguments follow the schema
    assert not accepts(required, call_text(fmt, "add", {"a": 1}))  # required properties
    assert not accepts(required, call_text(fmt, "get_weather", {"city": "Oslo", "unit": "kelvin"}))  # enums
    assert not accepts(required, call_text(fmt, "delete", {}))  # only offered tools

    single = forced_tool_grammar(fmt, TOOLS, function_name=None, parallel_tool_calls=False)
    assert accepts(single, one) and not accepts(single, two)

    named = forced_tool_grammar(fmt, TOOLS, function_name="get_weather", parallel_tool_calls=True)
    assert accepts(named, call_text(fmt, "get_weather", {"city": "Oslo", "unit": "fahrenheit"}))
    assert not accepts(named, one) and not accepts(named, two)
    # What the grammar admits, the parser reads back as calls with no content.
    parsed = parse_tool_calls(fmt, two, NAMES)
    assert parsed.content is None and [c.name for c in parsed.tool_calls] == ["add", "get_weather"]


def test_a_tool_without_parameters_takes_any_json_object():
    bare = {"type": "function", "function": {"name": "ping"}}
    spec = forced_tool_grammar(HERMES, [bare], function_name="ping", parallel_tool_calls=False)
    grammar = xgr.Grammar.from_structural_tag(spec)
    assert _is_grammar_accept_string(grammar, call_text(HERMES, "ping", {}))
    assert _is_grammar_accept_string(grammar, call_text(HERMES, "ping", {"any": [1, "x"]}))


# -- messages through the templates ------------------------------------------------------------------


@pytest.mark.parametrize("template, fmt", [(QWEN2_5_CHAT_TEMPLATE, HERMES), (LLAMA3_1_CHAT_TEMPLATE, LLAMA3_JSON)])
def test_assistant_tool_calls_and_tool_results_round_trip_through_the_template(tmp_path, template, fmt):
    from transformers import AutoTokenizer

    from gpuworker.demo_model import write_tokenizer

    write_tokenizer(tmp_path, 384, 1024)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.chat_template = template
    request = parse_request(
        ChatCompletionRequest,
        {
            "model": "m",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
            ],
        },
    )
    # What LLMEngine.render_chat does with a request's messages and tools.
    prompt = tokenizer.apply_chat_template(
        request.chat_messages(), tools=request.template_tools(), add_generation_prompt=True, tokenize=False
    )
    # The tools are in the prompt, the earlier call is written in the family's own format (so the
    # parser reads it back), and the tool's result follows it.
    assert '"name": "get_weather"' in prompt and "Current weather in a city" in prompt
    written = call_text(fmt, "get_weather", {"city": "Oslo", "unit": "celsius"})
    if fmt is HERMES:
        assert written in prompt
    else:  # Llama 3.1's template writes the call without a closing marker of its own
        assert written in prompt.replace("<|eot_id|>", "")
    parsed = parse_tool_calls(fmt, written, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})
    ]
    assert prompt.index(written) < prompt.index("temperature")  # (Llama's template re-quotes it)
    # tool_choice "none": the model is not told about tools.
    request.tool_choice = "none"
    assert request.template_tools() is None
