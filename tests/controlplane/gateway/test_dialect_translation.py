"""The dialects' translations on their own: requests into chat completion requests, chat chunks
into each dialect's stream events (including a stream the replica broke off)."""

import json

import pytest

from controlplane.gateway.dialects import parsed
from controlplane.gateway.dialects.anthropic_messages import MessagesRequest, MessagesStream, chat_request
from controlplane.gateway.dialects.responses import Responses, ResponsesRequest, chat_messages, input_items
from controlplane.gateway.errors import GatewayError


def _events(body: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in body.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def _chunk(content: str | None = None, calls: list | None = None, finish: str | None = None, **extra) -> dict:
    delta = {}
    if content is not None:
        delta["content"] = content
    if calls is not None:
        delta["tool_calls"] = calls
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}


CALL_OPENED = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]
CALL_ARGS = [{"index": 0, "function": {"arguments": '{"a": 1}'}}]


def test_anthropic_request_maps_onto_chat():
    request = parsed(
        MessagesRequest,
        json.dumps(
            {
                "model": "m",
                "max_tokens": 9,
                "system": [{"type": "text", "text": "Be terse."}],
                "stop_sequences": ["END"],
                "top_k": 3,
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "Calling."},
                            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}]},
                            {"type": "text", "text": "Thanks"},
                        ],
                    },
                ],
            }
        ).encode(),
    )
    chat = chat_request(request)
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "2"},
        {"role": "user", "content": "Thanks"},
    ]
    assert (chat["max_tokens"], chat["stop"], chat["top_k"]) == (9, ["END"], 3)
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 1, "messages": []}, "messages"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (
            {"model": "m", "max_tokens": 1, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
            "temperature",
        ),
    ],
)
def test_anthropic_bad_requests_name_the_field(body, param):
    with pytest.raises(GatewayError) as caught:
        parsed(MessagesRequest, json.dumps(body).encode())
    assert caught.value.status == 400 and caught.value.param == param


def test_anthropic_tool_use_from_a_user_is_refused():
    request = parsed(
        MessagesRequest,
        json.dumps(
            {
                "model": "m",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
            }
        ).encode(),
    )
    with pytest.raises(GatewayError) as caught:
        chat_request(request)
    assert caught.value.param == "messages.0"


def test_anthropic_stream_events_for_text_then_a_tool_call():
    stream = MessagesStream("m")
    body = stream.chunk(_chunk(content=""))  # the role chunk: opens the message only
    body += stream.chunk(_chunk(content="Hi"))
    body += stream.chunk(_chunk(calls=CALL_OPENED))
    body += stream.chunk(_chunk(calls=CALL_ARGS, finish="tool_calls"))
    body += stream.finish({"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.002})
    events = _events(body)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert events[4][1]["index"] == 1 and events[4][1]["content_block"]["type"] == "tool_use"
    assert events[5][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert events[7][1]["delta"]["stop_reason"] == "tool_use"
    assert events[7][1]["usage"]["output_tokens"] == 3
    failed = _events(MessagesStream("m").failed("The replica failed.", "replica_failed"))
    assert failed == [("error", {"type": "error", "error": {"type": "api_error", "message": "The replica failed."}})]


# Two tool calls whose argument fragments interleave: the first call's end comes after the second
# opened (then the second's end, and a third call whose arguments never make whole JSON).
INTERLEAVED = [
    [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Os'}}],
    [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"q": '}}],
    [{"index": 0, "function": {"arguments": 'lo"}'}}],
    [{"index": 2, "id": "call_3", "type": "function", "function": {"name": "h", "arguments": "{"}}],
    [{"index": 1, "function": {"arguments": "1}"}}],
]
INTERLEAVED_CALLS = [("call_1", "f", '{"city": "Oslo"}'), ("call_2", "g", '{"q": 1}'), ("call_3", "h", "{")]


def test_anthropic_stream_message_start_reports_the_prompt_tokens():
    stream = MessagesStream("m")
    stream.prompt_tokens = 5  # as the relay sets it from the replica's header
    body = stream.chunk(_chunk(content="Hi")) + stream.finish({"prompt_tokens": 5, "completion_tokens": 1})
    events = _events(body)
    assert events[0][1]["message"]["usage"]["input_tokens"] == 5
    assert events[-2][1]["usage"]["input_tokens"] == 5


def test_anthropic_usage_splits_the_prompt_into_uncached_and_cached_tokens():
    """Anthropic's input_tokens leave out the tokens read from the cache: the parts sum to the prompt."""
    stream = MessagesStream("m")
    stream.prompt_tokens, stream.cached_prompt_tokens = 40, 32  # as the relay sets them from the replica's headers
    usage = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}
    events = _events(stream.chunk(_chunk(content="Hi")) + stream.finish(usage))
    split = {"input_tokens": 8, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32}
    assert events[0][1]["message"]["usage"] == {**split, "output_tokens": 0}
    assert events[-2][1]["usage"] == {**split, "output_tokens": 1}


def test_anthropic_stream_interleaved_tool_calls_are_whole_blocks_one_after_another():
    stream = MessagesStream("m")
    body = b"".join(stream.chunk(_chunk(calls=calls)) for calls in INTERLEAVED)
    body += stream.finish({"prompt_tokens": 5, "completion_tokens": 9})
    blocks: dict[int, list] = {}
    order = []
    for name, data in _events(body):
        if name == "content_block_start":
            block = data["content_block"]
            blocks[data["index"]] = [block["id"], block["name"], ""]
            order.append(("start", data["index"]))
        elif name == "content_block_delta":
            assert order[-1][1] == data["index"]  # into the open block only
            blocks[data["index"]][2] += data["delta"]["partial_json"]
        elif name == "content_block_stop":
            order.append(("stop", data["index"]))
    assert order == [("start", 0), ("stop", 0), ("start", 1), ("stop", 1), ("start", 2), ("stop", 2)]
    assert [tuple(blocks[i]) for i in range(3)] == INTERLEAVED_CALLS


def test_responses_items_become_chat_messages():
    items = input_items(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": "Let me look."},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "reasoning", "summary": []},
        ]
    )
    assert [item["type"] for item in items] == [
        "message",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
    ]
    messages = chat_messages("Be kind.", items)
    assert messages[0] == {"role": "system", "content": "Be kind."}
    assert messages[2]["role"] == "assistant" and messages[2]["content"] == "Let me look."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "1"}


def _responses_stream():
    dialect = Responses()
    dialect.request = parsed(ResponsesRequest, json.dumps({"model": "m", "input": "x"}).encode())
    return dialect.stream()


def test_responses_stream_events_for_text_then_a_tool_call():
    stream = _responses_stream()
    body = stream.chunk(_chunk(content=""))
    body += stream.chunk(_chunk(content="Hi"))
    body += stream.chunk(_chunk(calls=CALL_OPENED))
    body += stream.chunk(_chunk(calls=CALL_ARGS, finish="tool_calls"))
    body += stream.finish({"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.002})
    events = _events(body)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [data["type"] for _, data in events] == [name for name, _ in events]
    call = events[11][1]["item"]
    assert events[11][1]["output_index"] == 1
    assert (call["type"], call["call_id"], call["name"], call["arguments"]) == (
        "function_call",
        "call_1",
        "f",
        '{"a": 1}',
    )
    final = events[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["usage"]["output_tokens"] == 3 and final["status"] == "completed"


def test_responses_stream_broken_off_ends_with_error_and_failed():
    stream = _responses_stream()
    body = stream.chunk(_chunk(content="Hi"))
    body += stream.failed("The replica failed.", "replica_failed")
    names = [name for name, _ in _events(body)]
    assert names[-2:] == ["error", "response.failed"]


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([{"type": "computer_call"}], "input.0.type"),
        ([{"role": "user", "content": 3}], "input.0.content"),
        ([{"type": "function_call", "call_id": "c", "name": "f"}], "input.0.arguments"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input.0.content.0"),
    ],
)
def test_responses_malformed_items_name_the_field(value, param):
    with pytest.raises(GatewayError) as caught:
        input_items(value)
    assert caught.value.status == 400 and caught.value.param == param


def test_responses_stream_interleaved_tool_calls_are_whole_items_one_after_another():
    stream = _responses_stream()
    body = b"".join(stream.chunk(_chunk(calls=calls)) for calls in INTERLEAVED)
    body += stream.finish({"prompt_tokens": 5, "completion_tokens": 9})
    events = _events(body)
    streamed: dict[int, str] = {}
    for name, data in events:
        if name == "response.function_call_arguments.delta":
            streamed[data["output_index"]] = streamed.get(data["output_index"], "") + data["delta"]
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert [(item["call_id"], item["name"], item["arguments"]) for item in done] == INTERLEAVED_CALLS
    assert [streamed[i] for i in range(3)] == [arguments for _, _, arguments in INTERLEAVED_CALLS]
    assert [item["arguments"] for item in events[-1][1]["response"]["output"]] == [a for *_, a in INTERLEAVED_CALLS]
