"""JSON mode, JSON schemas and tool calls through the public /v1 API with the official `openai`
SDK: a replica of a tiny random Qwen-family checkpoint (with Qwen2.5's real chat template) behind
the gateway. The model's free output is noise; the constrained output still parses and validates.
A request the replica refuses (a schema it cannot use) reaches the client as OpenAI's 400 and is
not billed."""

from __future__ import annotations

import json
import os
from decimal import Decimal
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from controlplane.billing.models import CreditEntry, UsageRecord
from controlplane.billing.selectors import credit_balance
from tests.controlplane.gateway.conftest import make_world, start_module_gateway, start_replica, wait_ready

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MAX_MODEL_LEN = 4096  # Qwen's tool prompt is long in one-byte tokens
ASK = [{"role": "user", "content": "What is the weather in Oslo this week?"}]


class Forecast(BaseModel):
    # Strings limited by an ASCII pattern, not max_length: xgrammar admits overlong UTF-8 byte
    # sequences in strings, which a noise model writes and which decode to several U+FFFD each.
    city: str = Field(pattern=r"^[A-Za-z ]{1,10}$")
    unit: Literal["celsius", "fahrenheit"]
    days: list[int] = Field(max_length=3)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def tool_replica(tmp_path_factory):
    from tests.gpuworker.replica.tool_templates import tool_checkpoint

    path = tool_checkpoint(tmp_path_factory.mktemp("structured"), "qwen2", max_position_embeddings=MAX_MODEL_LEN)
    replica = start_replica(path, "tiny-qwen", max_model_len=MAX_MODEL_LEN, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield replica
    finally:
        replica.kill()


@pytest.fixture(scope="module")
def structured_gateway(tool_replica, database_url):
    server = start_module_gateway(database_url)
    yield server
    server.stop()


@pytest.fixture
def world(structured_gateway, tool_replica):
    wait_ready(tool_replica)
    world = make_world(structured_gateway, [tool_replica])
    yield world
    world.settled(15)  # settlement is written after the answer: wait before the tables are emptied


def test_sdk_parse_with_a_pydantic_model_end_to_end(world):
    client = world.client()
    response = client.chat.completions.with_raw_response.parse(
        model=world.model.public_name, messages=ASK, response_format=Forecast, seed=4, max_tokens=300
    )
    completion = response.parse()
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    world.settled()
    record = UsageRecord.objects.get(request_id=response.headers["x-request-id"])
    assert (record.status, record.price_charged) == ("completed", Decimal("0.002"))


def test_json_object_and_json_schema_outputs_parse(world):
    client = world.client()
    reply = client.chat.completions.create(
        model=world.model.public_name,
        messages=ASK,
        n=3,
        seed=1,
        max_tokens=300,
        response_format={"type": "json_object"},
    )
    stopped = [c for c in reply.choices if c.finish_reason == "stop"]
    assert stopped
    assert all(isinstance(json.loads(c.message.content), dict) for c in stopped)
    stream = client.chat.completions.create(
        model=world.model.public_name,
        messages=ASK,
        seed=2,
        max_tokens=300,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "forecast", "strict": True, "schema": Forecast.model_json_schema()},
        },
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    Forecast.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def test_forced_tool_call_streamed_and_not(world):
    client = world.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=world.model.public_name,
        messages=ASK,
        seed=3,
        max_tokens=300,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=named,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert len(arguments["city"]) <= 10

    stream = client.chat.completions.create(
        model=world.model.public_name,
        messages=ASK,
        seed=3,
        max_tokens=300,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=named,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == "" and len(deltas) > 2  # the arguments arrive in pieces
    # Same seed, same tokens: the streamed call is the non-streamed one.
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0


def test_a_schema_the_replica_cannot_use_is_400_and_not_billed(world):
    client = world.client()
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
    }
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=world.model.public_name, messages=ASK, max_tokens=5, response_format=bad, stream=stream
            )
        assert caught.value.body["param"] == "response_format.json_schema.schema"
        assert caught.value.body["type"] == "invalid_request_error"
    # Refused by the gateway itself, before any replica: a tool_choice naming no tool.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=world.model.public_name,
            messages=ASK,
            max_tokens=5,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert caught.value.body["param"] == "tool_choice.function.name"
    world.settled()
    assert not UsageRecord.objects.filter(tenant=world.tenant).exists()
    assert not CreditEntry.objects.filter(tenant=world.tenant, kind="usage").exists()
    assert credit_balance(tenant=world.tenant) == Decimal("10")
