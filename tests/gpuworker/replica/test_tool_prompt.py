"""The tool fallback for chat templates that do not render tools: the conversation it writes, and
that the calls it asks for read back through the Hermes parser (forced calls) or the generic
parser (tool_choice "auto")."""

from __future__ import annotations

import json

from gpuworker.contract.openai_api import ChatCompletionRequest, parse_request
from gpuworker.replica.generic_tool_calls import (
    GenericToolParser,
    generic_calls_text,
    generic_result_text,
    generic_tools_instruction,
)
from gpuworker.replica.tool_calls import parse_tool_calls
from gpuworker.replica.tool_prompt import FALLBACK_FORMAT, call_text, tools_system_prompt, with_tools_in_prompt
from tests.gpuworker.replica.test_tool_calls import ADD, TOOLS, WEATHER


def _messages(messages: list[dict]) -> list[dict]:
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": messages}).chat_messages()


def test_tools_join_the_system_message_or_make_one():
    instruction = tools_system_prompt(TOOLS)
    assert json.dumps(WEATHER["function"]) in instruction and json.dumps(ADD["function"]) in instruction
    joined = with_tools_in_prompt(
        _messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]), instruction
    )
    assert joined == [{"role": "system", "content": "Be brief.\n\n" + instruction}, {"role": "user", "content": "hi"}]
    made = with_tools_in_prompt(_messages([{"role": "user", "content": "hi"}]), instruction)
    assert made == [{"role": "system", "content": instruction}, {"role": "user", "content": "hi"}]


HISTORY = [
    {"role": "user", "content": "Weather in Oslo, and 1 + 2?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "3"},
]


def test_calls_and_results_in_the_history_become_text():
    _, user, assistant, results = with_tools_in_prompt(_messages(HISTORY), tools_system_prompt(TOOLS))
    assert user == {"role": "user", "content": "Weather in Oslo, and 1 + 2?"}
    assert assistant["role"] == "assistant" and assistant["content"].startswith("Checking.\n<tool_call>")
    # Two results in a row are one user turn: templates that need alternating roles accept it.
    assert results == {
        "role": "user",
        "content": '<tool_response>\n{"temperature": 21}\n</tool_response>\n<tool_response>\n3\n</tool_response>',
    }
    # The history's calls are in exactly the format the parser reads back.
    parsed = parse_tool_calls(FALLBACK_FORMAT, assistant["content"], {"get_weather", "add"})
    assert parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("add", {"a": 1, "b": 2}),
    ]


def test_call_text_is_what_the_forced_grammar_writes():
    # The structural tag writes tag_begin + name + tag_middle + arguments + tag_end.
    fmt = FALLBACK_FORMAT
    assert call_text("add", {"a": 1}) == fmt.tag_begin + "add" + fmt.tag_middle + '{"a": 1}' + fmt.tag_end


def test_the_generic_format_writes_history_as_its_grammar_does():
    """tool_choice "auto" (generic_tool_calls): earlier calls are the JSON object the model writes."""
    instruction = generic_tools_instruction(TOOLS, parallel_tool_calls=True)
    system, _, assistant, results = with_tools_in_prompt(
        _messages(HISTORY), instruction, generic_calls_text, generic_result_text
    )
    assert system == {"role": "system", "content": instruction}
    text = assistant["content"]
    assert text.startswith("Checking.\n")
    parser = GenericToolParser()
    parser.feed(text[len("Checking.\n") :])
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert results == {
        "role": "user",
        "content": '{"tool_response": "{\\"temperature\\": 21}"}\n{"tool_response": "3"}',
    }
