"""POST /v1/embeddings on a replica serving all-MiniLM-L6-v2: OpenAI's shapes, and its errors."""

import base64

import httpx
import numpy as np
import pytest

from gpuworker.replica.app import ServerConfig
from tests.gpuworker.replica.test_app import TOKEN, _client, _config, _serving


@pytest.fixture(scope="module")
def encoder(minilm_checkpoint):
    with _serving(ServerConfig(model=str(minilm_checkpoint), served_model_name="minilm", token=TOKEN)) as running:
        yield running[0]


def _embed(base: str, **body) -> httpx.Response:
    with _client(base) as client:
        return client.post("/v1/embeddings", json={"model": "minilm", **body})


def test_string_list_and_token_id_inputs(encoder):
    one = _embed(encoder, input="hello world").json()
    assert one["object"] == "list" and one["model"] == "minilm"
    assert [d["index"] for d in one["data"]] == [0] and len(one["data"][0]["embedding"]) == 384
    assert one["usage"] == {"prompt_tokens": 4, "total_tokens": 4}  # [CLS] hello world [SEP]
    many = _embed(encoder, input=["hello world", "another sentence here"]).json()
    assert len(many["data"]) == 2
    np.testing.assert_allclose(many["data"][0]["embedding"], one["data"][0]["embedding"], atol=1e-5)
    ids = [101, 7592, 2088, 102]  # the same tokens as ids: the same vector
    by_ids = _embed(encoder, input=ids).json()
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], one["data"][0]["embedding"], atol=1e-5)
    lists = _embed(encoder, input=[ids, ids[:2]]).json()
    assert len(lists["data"]) == 2 and lists["usage"]["prompt_tokens"] == 6


def test_base64_is_the_same_float32_vector(encoder):
    floats = _embed(encoder, input="hello world").json()["data"][0]["embedding"]
    encoded = _embed(encoder, input="hello world", encoding_format="base64").json()["data"][0]["embedding"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(encoded), dtype="<f4"), floats, atol=1e-7)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 128}, "dimensions"),  # the model declares no Matryoshka dimensions
        ({"input": "word " * 400}, "input"),  # past max_seq_length (256)
        ({"input": [101, 10**6]}, "input"),
    ],
)
def test_bad_input_is_400_naming_the_field(encoder, body, param):
    response = _embed(encoder, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_model_own_dimensions_are_accepted(encoder):
    assert len(_embed(encoder, input="x", dimensions=384).json()["data"][0]["embedding"]) == 384


def test_generation_on_an_encoder_and_embeddings_on_a_decoder_are_clear_400s(encoder, tiny_checkpoint):
    with _client(encoder) as client:
        chat = client.post(
            "/v1/chat/completions", json={"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}
        )
    assert chat.status_code == 400 and "/v1/embeddings" in chat.json()["error"]["message"]
    with _serving(_config(tiny_checkpoint)) as (base, _), _client(base) as client:
        wrong = client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_model_kind"
