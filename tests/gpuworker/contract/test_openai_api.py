"""The request schema both the gateway and the replicas apply: bodies, and field types as OpenAI checks them."""

import pytest

from gpuworker.contract.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ProtocolError,
    parse_json_body,
    parse_request,
)

CHAT = [{"role": "user", "content": "hi"}]
SAMPLED = [(ChatCompletionRequest, {"messages": CHAT}), (CompletionRequest, {"prompt": "x"})]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"a": "' + b"[" * 100_000 + b'"}', None),  # deep-looking text is just text
        (b'{"prompt": "\xff"}', "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
    ],
)
def test_bodies_are_a_json_object_or_a_400(raw, message):
    if message is None:
        assert parse_json_body(raw)["a"].startswith("[")
        return
    with pytest.raises(ProtocolError, match=message) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
        (b'{"messages": [{"role": "user", "content": "ok \\uDFFF"}]}', "messages.0.content"),
        (b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # the UTF-8 form of a surrogate, which json.loads lets through
        (b'{"tools": [{"\\ud800": 1}]}', "tools.0"),  # a bad key: named by its object
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(raw, param):
    with pytest.raises(ProtocolError, match="lone UTF-16 surrogate") as caught:
        parse_json_body(raw)
    assert caught.value.param == param


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    assert parse_json_body(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}') == {"a": "\U0001f600", "b": "\\ud800"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "4"}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"n": True}, "n"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        ({"logprobs": "true"}, "logprobs"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ],
)
def test_fields_of_the_wrong_type_are_a_400_naming_them(fields, param):
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, {"messages": CHAT, **fields})
    assert caught.value.param is not None and caught.value.param.startswith(param)


def test_an_int_is_still_a_number_where_a_float_is_asked():
    request = parse_request(
        ChatCompletionRequest,
        {
            "messages": CHAT,
            "temperature": 1,
            "top_p": 1,
            "presence_penalty": 0,
            "stream_options": {"include_usage": True},
        },
    )
    assert request.temperature == 1.0 and isinstance(request.temperature, float)
    completion = parse_request(CompletionRequest, {"prompt": [1, 2, 3], "max_tokens": 3, "echo": True})
    assert completion.prompt == [1, 2, 3] and completion.echo


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"5": 100.5}, "bias of token 5 is 100.5; it must be a number from -100 to 100"),
        ({"5": -101}, "from -100 to 100"),
        ({"5": "1"}, "from -100 to 100"),
        ({"5": True}, "from -100 to 100"),
        ({"5": None}, "from -100 to 100"),
        ({"-5": 1}, "'-5' is not a token id"),
        ({"five": 1}, "'five' is not a token id"),
        ({"": 1}, "'' is not a token id"),
        ({"٣": 1}, "is not a token id"),  # a digit, but not an ASCII one
        ({str(i): 1 for i in range(301)}, "301 tokens given; at most 300"),
        ([5, 1], "must be an object mapping token ids to biases"),
    ],
)
@pytest.mark.parametrize("schema, base", SAMPLED)
def test_logit_bias_is_checked_as_openai_does(schema, base, bias, message):
    with pytest.raises(ProtocolError, match=message) as caught:
        parse_request(schema, {**base, "logit_bias": bias})
    assert caught.value.param == "logit_bias" and caught.value.status == 400


def test_logit_bias_reaches_the_sampling_parameters_as_ids_and_floats():
    request = parse_request(CompletionRequest, {"prompt": "x", "logit_bias": {"50256": -100, "007": 2.5}})
    assert request.sampling_kwargs()["logit_bias"] == {50256: -100.0, 7: 2.5}
    assert parse_request(CompletionRequest, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(300)}})
    for absent in ({}, {"logit_bias": None}, {"logit_bias": {}}):
        assert parse_request(CompletionRequest, {"prompt": "x", **absent}).sampling_kwargs()["logit_bias"] is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"best_of": 2}, "generating 2 candidates to return the best 1 is not supported"),
        ({"best_of": 4, "n": 2}, "generating 4 candidates to return the best 2"),
        ({"best_of": 2, "n": 3}, "must be at least n"),
        ({"best_of": 0}, "greater than or equal to 1"),
    ],
)
@pytest.mark.parametrize("schema, base", SAMPLED)
def test_best_of_beyond_n_is_refused(schema, base, fields, message):
    with pytest.raises(ProtocolError, match=message) as caught:
        parse_request(schema, {**base, **fields})
    assert caught.value.param == "best_of"


@pytest.mark.parametrize("fields", [{"best_of": 1}, {"best_of": 1, "n": 3}, {"best_of": 3, "n": 3}, {"best_of": None}])
def test_best_of_equal_to_n_or_1_means_n(fields):
    request = parse_request(CompletionRequest, {"prompt": "x", **fields})
    assert request.sampling_kwargs()["n"] == fields.get("n", 1)


def test_embeddings_refuse_stream_and_take_no_n():
    base = {"model": "m", "input": "hi"}
    with pytest.raises(ProtocolError, match="streaming is not supported") as caught:
        parse_request(EmbeddingRequest, {**base, "stream": True})
    assert caught.value.param == "stream" and caught.value.status == 400
    assert parse_request(EmbeddingRequest, {**base, "stream": False}).stream is False
    # Not a field of the embeddings API: a client's n is ignored, as any unknown field, and the
    # request counts once (the gateway holds credit and slots for `n` requests).
    assert parse_request(EmbeddingRequest, {**base, "n": -5}).n == 1
    assert parse_request(EmbeddingRequest, {**base, "n": 16}).n == 1


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_an_empty_prompt_is_a_400_in_every_form(prompt):
    with pytest.raises(ProtocolError, match="prompt must not be empty") as caught:
        parse_request(CompletionRequest, {"model": "m", "prompt": prompt})
    assert caught.value.param == "prompt"


def _chat_with_parts(*parts, role: str = "user") -> dict:
    return {"messages": [{"role": "system", "content": "hi"}, {"role": role, "content": list(parts)}]}


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}


def test_image_parts_are_read_in_order_with_their_places():
    from gpuworker.contract.openai_api import ImageInput

    request = parse_request(
        ChatCompletionRequest,
        _chat_with_parts(
            {"type": "text", "text": "what is"},
            IMAGE,
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
        ),
    )
    assert request.images() == [
        ImageInput("messages.1.content.1.image_url", IMAGE["image_url"]["url"], "low"),
        ImageInput("messages.1.content.2.image_url", "https://x.test/a.png", "auto"),
    ]
    assert request.messages[1].text() == "what is"
    assert request.messages[1].content_parts() == [
        {"type": "text", "text": "what is"},
        {"type": "image"},
        {"type": "image"},
    ]


@pytest.mark.parametrize(
    "part, param, words",
    [
        (
            {"type": "image_url", "image_url": {"url": "ftp://x/a.png"}},
            "messages.1.content.2.image_url.url",
            "not an image URL",
        ),
        ({"type": "image_url", "image_url": {"url": 5}}, "messages.1.content.2.image_url.url", "not an image URL"),
        (
            {"type": "image_url", "image_url": "https://x.test/a.png"},
            "messages.1.content.2.image_url",
            "must be an object",
        ),
        (
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png", "detail": "max"}},
            "messages.1.content.2.image_url.detail",
            "'max'",
        ),
        ({"type": "input_audio", "input_audio": {}}, "messages.1.content.2.type", "'input_audio'"),
        ({"type": "text"}, "messages.1.content.2.text", "text"),
        ("just text", "messages.1.content.2", "object"),
    ],
)
def test_a_bad_content_part_is_400_naming_the_part(part, param, words):
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, _chat_with_parts({"type": "text", "text": "a"}, IMAGE, part))
    assert caught.value.param == param and caught.value.status == 400
    assert caught.value.message.startswith(param + ": ") and words in caught.value.message


def test_only_user_messages_carry_images():
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, _chat_with_parts(IMAGE, role="assistant"))
    assert caught.value.param == "messages.1.content.0"
