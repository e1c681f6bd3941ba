"""The Responses API and Anthropic's Messages API through the gateway, driven by the official
`openai`, `anthropic` and `openai-agents` clients against a replica of a tiny random Qwen-family
checkpoint (with Qwen2.5's real chat template, so tool calls are parsed). Each request is
admitted, held, routed and settled by the chat path: billed once, like a chat completion."""

from __future__ import annotations

import asyncio
import json
import os
import socketserver
import threading
import time
import uuid
from decimal import Decimal
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from controlplane.billing.models import CreditEntry, UsageRecord
from controlplane.gateway.models import StoredResponse
from tests.controlplane.gateway.conftest import (
    answer_one_request,
    make_world,
    start_module_gateway,
    start_replica,
    wait_ready,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MAX_MODEL_LEN = 4096  # Qwen's tool prompt is long in one-byte tokens
PRICE = Decimal("0.002")


class Unit(BaseModel):
    unit: Literal["celsius", "fahrenheit"]


WEATHER = {
    "type": "function",
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
}


@pytest.fixture(scope="module")
def tool_replica(tmp_path_factory):
    from tests.gpuworker.replica.tool_templates import tool_checkpoint

    path = tool_checkpoint(tmp_path_factory.mktemp("dialects"), "qwen2", max_position_embeddings=MAX_MODEL_LEN)
    replica = start_replica(path, "tiny-qwen", max_model_len=MAX_MODEL_LEN, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield replica
    finally:
        replica.kill()


@pytest.fixture(scope="module")
def dialects_gateway(tool_replica, database_url):
    server = start_module_gateway(database_url)
    yield server
    server.stop()


@pytest.fixture
def world(dialects_gateway, tool_replica):
    wait_ready(tool_replica)
    world = make_world(dialects_gateway, [tool_replica], price=PRICE)
    yield world
    world.settled(15)


def anthropic_client(world, api_key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=world.base_url, api_key=api_key or world.api_key.plaintext, max_retries=0, timeout=60
    )


def billed_once(world, request_ids: list[str]) -> None:
    """Each request is one completed usage record and one charge; nothing else was charged."""
    world.settled()
    records = UsageRecord.objects.filter(tenant=world.tenant)
    assert sorted(r.request_id for r in records) == sorted(request_ids)
    assert all(r.status == "completed" and r.price_charged == PRICE for r in records)
    charges = CreditEntry.objects.filter(tenant=world.tenant, kind="usage")
    assert charges.count() == len(request_ids)
    assert sum(-c.amount for c in charges) == PRICE * len(request_ids)


def test_responses_create_retrieve_input_items_chain_and_delete(world):
    client = world.client()
    raw = client.responses.with_raw_response.create(
        model=world.model.public_name, input="Hello there", instructions="Be brief.", max_output_tokens=5
    )
    first = raw.parse()
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output[0].type == "message" and first.output_text == first.output[0].content[0].text
    assert first.usage.output_tokens == 5 and first.usage.input_tokens > 0
    assert first.instructions == "Be brief." and first.model == world.model.public_name

    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello there")]

    second_raw = client.responses.with_raw_response.create(
        model=world.model.public_name, input="And again", previous_response_id=first.id, max_output_tokens=3
    )
    second = second_raw.parse()
    assert second.previous_response_id == first.id
    stored = StoredResponse.objects.get(id=second.id)
    texts = [item.get("content", [{}])[0].get("text") for item in stored.history]
    assert texts == ["Hello there", first.output_text, "And again", second.output_text]

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored_raw = client.responses.with_raw_response.create(
        model=world.model.public_name, input="Forget this", store=False, max_output_tokens=2
    )
    unstored = unstored_raw.parse()
    assert unstored.store is False and not StoredResponse.objects.filter(id=unstored.id).exists()
    with pytest.raises(openai.NotFoundError) as caught:  # the chain's link is gone: 404, not billed
        client.responses.create(model=world.model.public_name, input="x", previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"
    request_ids = [raw, second_raw, unstored_raw]
    billed_once(world, [r.headers["x-request-id"] for r in request_ids])


def test_responses_stream_event_sequence(world):
    client = world.client()
    raw = client.responses.with_raw_response.create(
        model=world.model.public_name, input="Tell me a story", max_output_tokens=8, stream=True
    )
    events, request_id = list(raw.parse()), raw.headers["x-request-id"]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == text  # stored before the stream ended

    # The SDK's own accumulating helper reads the same events (of a response that completes: its
    # JSON schema ends it).
    with client.responses.stream(
        model=world.model.public_name, input="Which unit?", text_format=Unit, max_output_tokens=100
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_parsed.unit in ("celsius", "fahrenheit")
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() == 2
    assert UsageRecord.objects.filter(request_id=request_id).exists()


def test_responses_function_tool_round_trip_streamed_and_not(world):
    client = world.client()
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]}]
    forced = {"type": "function", "name": "get_weather"}
    response = client.responses.create(
        model=world.model.public_name,
        input=ask,
        tools=[WEATHER],
        tool_choice=forced,
        max_output_tokens=200,
        extra_body={"seed": 3},
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"}

    follow_up = client.responses.create(
        model=world.model.public_name,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=5,
    )
    assert follow_up.output[0].type == "message"
    history = StoredResponse.objects.get(id=follow_up.id).history
    assert [item["type"] for item in history] == ["message", "function_call", "function_call_output", "message"]

    events = list(
        client.responses.create(
            model=world.model.public_name,
            input=ask,
            tools=[WEATHER],
            tool_choice=forced,
            max_output_tokens=200,
            extra_body={"seed": 3},
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments  # same seed, same call
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    assert events[-1].type == "response.completed"


def test_responses_text_format_json_schema(world):
    schema = {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    response = world.client().responses.create(
        model=world.model.public_name,
        input="Which unit?",
        text={"format": {"type": "json_schema", "name": "unit", "schema": schema, "strict": True}},
        max_output_tokens=100,
        metadata={"case": "schema"},
    )
    assert json.loads(response.output_text)["unit"] in ("celsius", "fahrenheit")
    assert response.metadata == {"case": "schema"} and response.text.format.type == "json_schema"


def test_responses_unhappy_paths_are_refused_unbilled(world, dialects_gateway):
    from tests.controlplane.factories import ApiKeyFactory, TenantFactory

    client = world.client()
    model = world.model.public_name
    for bad, param in (
        ([{"type": "computer_call"}], "input.0.type"),
        ([{"role": "robot", "content": "hi"}], "input.0.role"),
        ([{"type": "function_call_output", "output": "x"}], "input.0.call_id"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.0.content.0"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=model, input=bad)
        assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi", background=True, store=False)
    assert caught.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="hi", previous_response_id="resp_unknown")
    with pytest.raises(openai.BadRequestError):  # longer than the model's context
        client.responses.create(model=model, input="word " * 5000)

    # Another tenant's response is as unknown as one never made: 404, nothing of it shown.
    mine = client.responses.create(model=model, input="secret", max_output_tokens=2)
    other = ApiKeyFactory(tenant=TenantFactory(plan=world.tenant.plan))
    theirs = world.client(api_key=other.plaintext)
    for call in (
        lambda: theirs.responses.retrieve(mine.id),
        lambda: theirs.responses.input_items.list(mine.id),
        lambda: theirs.responses.delete(mine.id),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert "secret" not in json.dumps(caught.value.body)
    assert client.responses.retrieve(mine.id).id == mine.id
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant).count() == 1  # only `mine`


def test_responses_client_leaving_mid_stream_is_settled_once(world, dialects_gateway):
    async def leave_early() -> str:
        body = {"model": world.model.public_name, "input": "Go on", "max_output_tokens": 400, "stream": True}
        headers = {"authorization": f"Bearer {world.api_key.plaintext}"}
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{world.base_url}/v1/responses", json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if "response.output_text.delta" in line:
                        return response.headers["x-request-id"]
        raise AssertionError("no delta arrived")

    request_id = asyncio.run(leave_early())
    world.settled(30)
    (record,) = UsageRecord.objects.filter(tenant=world.tenant)
    assert record.request_id == request_id and record.status == "cancelled"
    assert CreditEntry.objects.filter(tenant=world.tenant, kind="usage").count() == 1


def test_anthropic_messages_create_stream_and_billing(world):
    client = anthropic_client(world)
    raw = client.messages.with_raw_response.create(
        model=world.model.public_name,
        max_tokens=6,
        system="You are terse.",
        messages=[{"role": "user", "content": "Hello"}],
        temperature=0.5,
        top_k=20,
    )
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    assert message.content[0].type == "text" and message.usage.input_tokens > 0

    with client.messages.stream(
        model=world.model.public_name, max_tokens=6, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    # As Anthropic's API does, message_start already counts the prompt's tokens.
    (delta,) = [event for event in events if event.type == "message_delta"]
    assert events[0].message.usage.input_tokens == delta.usage.input_tokens == final.usage.input_tokens > 0
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.content[0].text
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() == 2
    assert raw.headers["request-id"] == raw.headers["x-request-id"]


def test_anthropic_usage_splits_a_cached_prompt_as_anthropic_does(world):
    """Sent again, a long prompt is mostly read from the replica's prefix cache: Anthropic's
    input_tokens count only the rest, so the usage's parts sum to the prompt, and a stream's
    message_start already splits it as its final usage does."""
    client = anthropic_client(world)
    prompt = uuid.uuid4().hex + " tell me about the sea" * 12
    ask = {"model": world.model.public_name, "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]}
    client.messages.create(**ask)  # fills the cache
    raw = client.messages.with_raw_response.create(**ask)
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        streamed, stream_id = stream.get_final_message().usage, stream.response.headers["x-request-id"]
    world.settled()
    for request_id, usage in ((raw.headers["x-request-id"], raw.parse().usage), (stream_id, streamed)):
        record = UsageRecord.objects.get(request_id=request_id)
        assert usage.cache_read_input_tokens == record.cached_prompt_tokens > record.prompt_tokens // 2
        assert usage.cache_creation_input_tokens == 0
        assert usage.input_tokens + usage.cache_read_input_tokens == record.prompt_tokens
    start = events[0].message.usage
    (delta,) = [event for event in events if event.type == "message_delta"]
    split = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert [getattr(start, name) for name in split] == [getattr(delta.usage, name) for name in split]


def test_anthropic_stop_sequence_is_named(world):
    client = anthropic_client(world)
    seen = (
        client.messages.create(
            model=world.model.public_name, max_tokens=30, messages=[{"role": "user", "content": "Hi"}], top_k=1
        )
        .content[0]
        .text
    )
    # Stop at a character of what the greedy model says (one that is text: the noise also makes
    # bytes that are no UTF-8, shown as U+FFFD, which no stop string matches).
    stop = next(ch for ch in seen if ch != "\ufffd")
    message = client.messages.create(
        model=world.model.public_name,
        max_tokens=30,
        messages=[{"role": "user", "content": "Hi"}],
        top_k=1,
        stop_sequences=[stop],
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


def test_anthropic_tool_use_round_trip(world):
    client = anthropic_client(world)
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    message = client.messages.create(
        model=world.model.public_name,
        max_tokens=200,
        messages=ask,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city", "unit"}

    answer = client.messages.create(
        model=world.model.public_name,
        max_tokens=5,
        tools=[tool],
        messages=[
            *ask,
            {"role": "assistant", "content": [block.model_dump() for block in message.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
        ],
    )
    assert answer.content[0].type == "text"

    # One call at most: with parallel calls allowed, "any" lets the model write call after call,
    # and a random model sometimes starts a second one that max_tokens cuts off (stop_reason
    # "max_tokens", rightly); a single call of this schema is about half of max_tokens.
    with client.messages.stream(
        model=world.model.public_name,
        max_tokens=200,
        messages=ask,
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    (streamed,) = [block for block in final.content if block.type == "tool_use"]
    assert streamed.name == "get_weather" and set(streamed.input) == {"city", "unit"}
    assert final.stop_reason == "tool_use"


def _sse_chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    event = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "x", "choices": choices}
    if usage is not None:
        event["usage"] = usage
    return _chunked(b"data: " + json.dumps(event).encode() + b"\n\n")


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _call(index: int, arguments: str, name: str | None = None) -> dict:
    call = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        call.update(id=f"call_{name}", type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


# A model whose two tool calls' argument fragments interleave (the first call's end comes after
# the second opened), streamed as a replica streams a chat completion.
INTERLEAVED_STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\nx-prompt-tokens: 7\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
    + _sse_chunk({"role": "assistant", "content": ""})
    + _sse_chunk(_call(0, '{"city": "Os', name="get_weather"))
    + _sse_chunk(_call(1, '{"city": "Ber', name="get_time"))
    + _sse_chunk(_call(0, 'lo", "unit": "celsius"}'))
    + _sse_chunk(_call(1, 'gen"}'), finish="tool_calls")
    + _sse_chunk(None, usage={"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19})
    + _chunked(b"data: [DONE]\n\n")
    + b"0\r\n\r\n"
)


class _Interleaving(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        answer_one_request(self.request, INTERLEAVED_STREAM)


@pytest.fixture(scope="module")
def interleaving_replica():
    """A stand-in replica answering every request with INTERLEAVED_STREAM."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Interleaving)
    server.daemon_threads = True
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_anthropic_stream_of_interleaved_tool_calls_keeps_every_argument(dialects_gateway, interleaving_replica):
    world = make_world(dialects_gateway, [interleaving_replica], price=PRICE)
    tools = [
        {"name": name, "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
        for name in ("get_weather", "get_time")
    ]
    with anthropic_client(world).messages.stream(
        model=world.model.public_name, max_tokens=50, tools=tools, messages=[{"role": "user", "content": "Oslo?"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(block.type, block.name, block.input) for block in final.content] == [
        ("tool_use", "get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("tool_use", "get_time", {"city": "Bergen"}),
    ]
    starts = [event.index for event in events if event.type == "content_block_start"]
    assert starts == [0, 1] and final.stop_reason == "tool_use"
    assert events[0].message.usage.input_tokens == final.usage.input_tokens == 7
    world.settled()


def test_anthropic_errors_are_in_anthropics_shape(world):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic_client(world, api_key="sk-wrong").messages.create(
            model=world.model.public_name, max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"

    headers = {"x-api-key": world.api_key.plaintext, "anthropic-version": "2023-06-01"}
    response = httpx.post(
        f"{world.base_url}/v1/messages",
        json={"model": world.model.public_name, "messages": [{"role": "user", "content": "Hi"}]},
        headers=headers,
    )
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client(world).messages.create(
            model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    assert caught.value.body["error"]["type"] == "not_found_error"
    too_large = httpx.post(
        f"{world.base_url}/v1/messages", content=b"x" * (4 * 1024 * 1024 + 1), headers=headers, timeout=60
    )
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"
    world.settled()
    assert not UsageRecord.objects.filter(tenant=world.tenant).exists()


def test_openai_agents_sdk_runs_an_agent_with_a_tool(world):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    calls: list[dict] = []

    @function_tool
    def get_weather(unit: Literal["celsius", "fahrenheit"]) -> str:
        """Forecast for Oslo."""
        calls.append({"unit": unit})
        return "Sunny"

    def forecaster() -> Agent:  # per event loop: its client's connections belong to one
        return Agent(
            name="forecaster",
            instructions="Answer with the forecast.",
            model=OpenAIResponsesModel(model=world.model.public_name, openai_client=world.async_client()),
            tools=[get_weather],
            # A random model would rarely call a tool unasked: the first turn must, then the agent
            # answers with what the tool said (tool_use_behavior stops after the first tool).
            model_settings=ModelSettings(tool_choice="get_weather", max_tokens=200),
            tool_use_behavior="stop_on_first_tool",
        )

    config = RunConfig(tracing_disabled=True)
    result = asyncio.run(Runner.run(forecaster(), "Weather in Oslo?", max_turns=3, run_config=config))
    assert len(calls) == 1 and result.final_output == "Sunny"

    async def streamed():  # the same run over the Responses API's stream
        run = Runner.run_streamed(forecaster(), "Weather in Oslo?", max_turns=3, run_config=config)
        async for _ in run.stream_events():
            pass
        return run

    run = asyncio.run(streamed())
    assert len(calls) == 2 and run.final_output == "Sunny"
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() == 2


def _until_finished(client, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response did not finish"
        time.sleep(0.2)
    return response


def test_background_response_runs_on_and_is_billed_once(world):
    client = world.client()
    queued = client.responses.create(model=world.model.public_name, input="Hello", max_output_tokens=5, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _until_finished(client, queued.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 5 and done.output_text
    with pytest.raises(openai.BadRequestError):  # only a background response can be cancelled
        client.responses.cancel(
            client.responses.create(model=world.model.public_name, input="x", max_output_tokens=1).id
        )
    assert client.responses.cancel(queued.id).status == "incomplete"  # finished: cancelling changes nothing
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() == 2


def test_background_response_cancelled_mid_generation(world):
    client = world.client()
    queued = client.responses.create(
        model=world.model.public_name, input="Go on", max_output_tokens=3000, background=True, temperature=0
    )
    time.sleep(1.5)
    assert client.responses.cancel(queued.id).status == "cancelled"
    world.settled(30)
    (record,) = UsageRecord.objects.filter(tenant=world.tenant)
    assert record.status == "cancelled"  # stopped as a client that left is: charged once it had started
    assert CreditEntry.objects.filter(tenant=world.tenant, kind="usage").count() == 1
    assert client.responses.retrieve(queued.id).status == "cancelled"
