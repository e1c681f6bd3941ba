"""The request schema both the gateway and the replicas apply: bodies, and field types as OpenAI checks them."""

import pytest

from gpuworker.contract.openai_api import (ChatCompletionRequest, CompletionRequest, ProtocolError, parse_json_body,
                                           parse_request)

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("raw", "message"), [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"a": "' + b"[" * 100_000 + b'"}', None),  # deep-looking text is just text
    (b'{"prompt": "\xff"}', "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
])
def test_bodies_are_a_json_object_or_a_400(raw, message):
    if message is None:
        assert parse_json_body(raw)["a"].startswith("[")
        return
    with pytest.raises(ProtocolError, match=message) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (b'{"messages": [{"role": "user", "content": "ok \\uDFFF"}]}', "messages.0.content"),
    (b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # the UTF-8 form of a surrogate, which json.loads lets through
    (b'{"tools": [{"\\ud800": 1}]}', "tools.0"),  # a bad key: named by its object
])
def test_a_lone_surrogate_is_a_400_naming_the_field(raw, param):
    with pytest.raises(ProtocolError, match="lone UTF-16 surrogate") as caught:
        parse_json_body(raw)
    assert caught.value.param == param


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    assert parse_json_body(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}') == {"a": "\U0001F600", "b": "\\ud800"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"n": True}, "n"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ({"logprobs": "true"}, "logprobs"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
])
def test_fields_of_the_wrong_type_are_a_400_naming_them(fields, param):
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, {"messages": CHAT, **fields})
    assert caught.value.param is not None and caught.value.param.startswith(param)


def test_an_int_is_still_a_number_where_a_float_is_asked():
    request = parse_request(ChatCompletionRequest, {"messages": CHAT, "temperature": 1, "top_p": 1,
                                                    "presence_penalty": 0, "stream_options": {"include_usage": True}})
    assert request.temperature == 1.0 and isinstance(request.temperature, float)
    completion = parse_request(CompletionRequest, {"prompt": [1, 2, 3], "max_tokens": 3, "echo": True})
    assert completion.prompt == [1, 2, 3] and completion.echo
