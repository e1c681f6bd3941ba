"""response_format and tool calling through the worker's /v1 API with the official openai SDK, on
tiny random checkpoints whose unconstrained output is noise: every output that finishes with
"stop" must parse and validate all the same, because the grammar allows nothing else."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field
from xgrammar.testing import _is_grammar_accept_string

from gpuworker.contract.openai_api import ChatCompletionRequest, parse_request
from gpuworker.engine import LLMEngine
from gpuworker.replica.app import ServerConfig
from gpuworker.replica.generic_tool_calls import generic_tools_instruction
from gpuworker.replica.response_format import grammar_schema, json_constraint
from gpuworker.replica.responses import plan_chat
from tests.gpuworker.replica.test_app import TOKEN, _serving
from tests.gpuworker.replica.tool_templates import tool_checkpoint

MAX_MODEL_LEN = 4096  # the families' tool prompts are long in one-byte tokens


# Strings are limited by ASCII patterns rather than max_length: xgrammar 0.2 admits overlong UTF-8
# byte sequences inside strings, which a noise model writes and which decode to several U+FFFD
# each, breaking a length limit (test_length_limited_strings_... covers max_length's grammar).
class Address(BaseModel):
    city: str = Field(pattern=r"^[A-Za-z ]{1,12}$")
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    """Nested objects, an enum, an array and required fields."""

    name: str = Field(pattern=r"^[A-Za-z ]{1,10}$")
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    active: bool


class Inventory(BaseModel):
    items: list[Address] = Field(min_length=1, max_length=2)
    total: int


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}


class Weather(BaseModel):
    city: str = Field(pattern=r"^[A-Za-z ]{1,10}$")
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tool_checkpoint(tmp_path_factory.mktemp("qwen"), "qwen2", max_position_embeddings=MAX_MODEL_LEN)
    with _serving(
        ServerConfig(model=str(path), served_model_name="tiny-qwen", token=TOKEN, max_model_len=MAX_MODEL_LEN)
    ) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Its engine steps in a process of its own: grammars compile there, tool calls are read here."""
    path = tool_checkpoint(tmp_path_factory.mktemp("llama"), "llama3.1", max_position_embeddings=MAX_MODEL_LEN)
    with _serving(
        ServerConfig(
            model=str(path),
            served_model_name="tiny-llama",
            token=TOKEN,
            max_model_len=MAX_MODEL_LEN,
            engine_process=True,
        )
    ) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    """A model whose chat template does not render tools (the demo's): tools go into the prompt."""
    path = tiny_checkpoint("llama", max_position_embeddings=MAX_MODEL_LEN)
    with _serving(
        ServerConfig(model=str(path), served_model_name="tiny-plain", token=TOKEN, max_model_len=MAX_MODEL_LEN)
    ) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def _stopped(choices) -> list:
    stopped = [c for c in choices if c.finish_reason in ("stop", "tool_calls")]
    assert stopped, f"no choice finished: {[c.finish_reason for c in choices]}"
    return stopped


# -- response_format ---------------------------------------------------------------------------------


def test_json_object_output_always_parses(qwen):
    reply = qwen.chat.completions.create(
        model="tiny-qwen", messages=ASK, response_format={"type": "json_object"}, n=6, seed=3, max_tokens=400
    )
    for choice in _stopped(reply.choices):
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("model", [Person, Inventory, Weather])
def test_json_schema_output_validates(qwen, model):
    schema = model.model_json_schema()
    reply = qwen.chat.completions.create(
        model="tiny-qwen",
        messages=ASK,
        n=4,
        seed=11,
        max_tokens=400,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": model.__name__, "schema": schema, "strict": True},
        },
    )
    for choice in _stopped(reply.choices):
        model.model_validate_json(choice.message.content)


def test_json_schema_streamed(qwen):
    stream = qwen.chat.completions.create(
        model="tiny-qwen",
        messages=ASK,
        seed=5,
        max_tokens=400,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}},
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    Weather.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks))


def test_sdk_parse_with_a_pydantic_model(qwen):
    completion = qwen.chat.completions.parse(
        model="tiny-qwen", messages=ASK, response_format=Weather, seed=2, max_tokens=400
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)


# -- tool calls --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen", "llama", "plain"])
def test_named_tool_choice_returns_a_call_matching_the_schema(request, family):
    client = request.getfixturevalue(family)
    model = f"tiny-{family}"
    reply = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        n=3,
        seed=7,
        max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        Weather.model_validate_json(call.function.arguments)
        assert choice.message.content is None  # no markup, no noise


@pytest.mark.parametrize("family", ["qwen", "llama", "plain"])
def test_forced_tool_call_streamed_like_openai(request, family):
    client = request.getfixturevalue(family)
    model = f"tiny-{family}"
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        seed=9,
        max_tokens=300,
        stream=True,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert all(not (c.choices[0].delta.content or "") for c in chunks)
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name in ("get_weather", "get_time") and first.function.arguments == ""
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments for d in rest)
    if first.function.name == "get_weather":
        Weather.model_validate_json(arguments)
    else:
        assert json.loads(arguments)["zone"] in ("UTC", "CET")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The same request not streamed gives the same call (same seed, same tokens).
    whole = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        seed=9,
        max_tokens=300,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (first.function.name, arguments)


def test_tool_results_continue_the_conversation(qwen):
    """An assistant's tool call and the tool's answer go back through the template."""
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21}'},
    ]
    base = qwen.chat.completions.create(model="tiny-qwen", messages=ASK, tools=TOOLS, max_tokens=1)
    reply = qwen.chat.completions.create(model="tiny-qwen", messages=messages, tools=TOOLS, max_tokens=2)
    call_text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius", "days": 1}}\n'
        "</tool_call>"
    )
    # The prompt grew by the call and the answer as the template writes them (one token per byte).
    grown = reply.usage.prompt_tokens - base.usage.prompt_tokens
    assert grown >= len(call_text) + len('{"temperature": 21}')


def test_length_limited_strings_exclude_what_json_must_escape():
    """xgrammar writes strings with minLength/maxLength as any characters but quote, backslash and
    newlines; the grammar's copy of the schema closes that gap (control characters would make the
    output invalid JSON)."""
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "minLength": 1, "maxLength": 3},
            "e": {"enum": [{"type": "string", "maxLength": 1}]},
        },
        "required": ["s"],
    }
    copy = grammar_schema(schema)
    assert schema["properties"]["s"] == {"type": "string", "minLength": 1, "maxLength": 3}  # unchanged
    assert copy["properties"]["e"] == schema["properties"]["e"]  # enum values are data, not schemas
    grammar = xgr.Grammar.from_structural_tag(json_constraint(schema).spec)
    assert _is_grammar_accept_string(grammar, '{"s": "abc"}')
    assert _is_grammar_accept_string(grammar, '{"s": "Zü"}')
    for bad in ('{"s": "a\x01b"}', '{"s": "a\tb"}', '{"s": "abcd"}', '{"s": ""}'):
        assert not _is_grammar_accept_string(grammar, bad)


# -- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": 3, "maxProperties": 1}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                        },
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id"),
    ],
)
def test_bad_requests_are_400_naming_the_field(qwen, body, param):
    response = httpx.post(
        f"{qwen.base_url}chat/completions",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={"model": "tiny-qwen", "messages": ASK, "max_tokens": 4, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]


def test_a_template_without_tools_gets_them_in_the_system_prompt(tiny_checkpoint):
    engine = LLMEngine(
        tiny_checkpoint("llama", max_position_embeddings=MAX_MODEL_LEN),
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
    )
    system = {"role": "system", "content": "Be brief."}
    request = parse_request(ChatCompletionRequest, {"model": "m", "messages": [system, *ASK], "tools": TOOLS})
    # auto: the generic format, one JSON object (a call or the response) that its grammar holds.
    plan = plan_chat(engine.prompts, request)
    prompt = engine.tokenizer.decode(plan.prompt.token_ids)
    # The demo template shows only roles and contents: the tools are in the system message's text.
    assert prompt.index("Be brief.") < prompt.index('"get_weather"') < prompt.index("What is the weather")
    assert generic_tools_instruction(TOOLS, parallel_tool_calls=True) in prompt
    assert plan.tool_parsing.generic and plan.params.structured_output.kind == "structural_tag"
    assert '"tool_call"' in plan.params.structured_output.spec
    # required: Hermes blocks, written by the forced-call grammar.
    request.tool_choice = "required"
    forced = plan_chat(engine.prompts, request)
    prompt = engine.tokenizer.decode(forced.prompt.token_ids)
    assert prompt.index("Be brief.") < prompt.index("<tools>") < prompt.index("What is the weather")
    for tool in TOOLS:
        assert json.dumps(tool["function"]) in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' in prompt
    assert not forced.tool_parsing.generic and forced.tool_parsing.fmt.name == "hermes"
    assert forced.params.structured_output.kind == "structural_tag"
    # tool_choice "none": the model is not told of the tools.
    request.tool_choice = "none"
    plan = plan_chat(engine.prompts, request)
    assert plan.tool_parsing is None and plan.params.structured_output is None
    assert "get_weather" not in engine.tokenizer.decode(plan.prompt.token_ids)


def _assert_generic_choice(choice) -> None:
    """A choice of tool_choice "auto" in the generic format: calls of offered tools with arguments
    that follow their schemas and no content, or content with none of the JSON wrapper."""
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
            if choice.finish_reason == "tool_calls":
                if call.function.name == "get_weather":
                    Weather.model_validate_json(call.function.arguments)
                else:
                    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    else:
        assert choice.finish_reason in ("stop", "length")
        assert not (choice.message.content or "").lstrip().startswith("{")


def test_auto_on_a_template_without_tools_answers_in_the_generic_format(plain):
    """A random model's choice is noise, but the grammar holds it to a call or the response, and
    each comes back as OpenAI's calls or as bare content. (This one answers: its strings are long
    noise, cut by max_tokens. Calls through this path: tests/controlplane/gateway/test_demo_chat_model.py.)"""
    reply = plain.chat.completions.create(model="tiny-plain", messages=ASK, tools=TOOLS, n=12, seed=3, max_tokens=48)
    for choice in reply.choices:
        _assert_generic_choice(choice)
    assert any(c.message.content for c in reply.choices)
    # Streamed, each choice adds up to the same message (same seed, same tokens).
    stream = plain.chat.completions.create(
        model="tiny-plain", messages=ASK, tools=TOOLS, n=12, seed=3, max_tokens=48, stream=True
    )
    streamed = [c for chunk in stream for c in chunk.choices]
    for whole in reply.choices:
        mine = [c for c in streamed if c.index == whole.index]
        content = "".join(c.delta.content or "" for c in mine)
        deltas = [d for c in mine for d in (c.delta.tool_calls or [])]
        calls = [
            (d.function.name, "".join(e.function.arguments for e in deltas if e.index == d.index and not e.id))
            for d in deltas
            if d.id
        ]
        assert (content or None) == whole.message.content
        assert calls == [(call.function.name, call.function.arguments) for call in whole.message.tool_calls or []]
        assert mine[-1].finish_reason == whole.finish_reason


@pytest.mark.parametrize(
    "grammar",
    [
        lambda: json_constraint({"type": "object"}).spec,
        lambda: json_constraint(WEATHER_PARAMETERS).spec,
    ],
    ids=["json_object", "json_schema"],
)
def test_response_format_grammars_allow_one_blank_at_most(grammar):
    compiled = xgr.Grammar.from_structural_tag(grammar())
    assert _is_grammar_accept_string(compiled, '{"city": "Oslo", "unit": "celsius", "days": 2}')
    assert _is_grammar_accept_string(compiled, '{"city":"Oslo","unit":"celsius","days":2}')
    assert not _is_grammar_accept_string(compiled, '{"city":  "Oslo", "unit": "celsius", "days": 2}')
    assert not _is_grammar_accept_string(compiled, '{\n    "city": "Oslo", "unit": "celsius", "days": 2}')
