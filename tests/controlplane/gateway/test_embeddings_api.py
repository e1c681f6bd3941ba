"""POST /v1/embeddings through the gateway with the official `openai` SDK: a replica of the real
all-MiniLM-L6-v2 behind it, the same auth, rate limits, holds and flat per-request billing as the
completions; a generation request to an embedding model, and the reverse, are clear 400s."""

from __future__ import annotations

import os
from decimal import Decimal

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, BertModel

from controlplane.billing.models import UsageRecord
from controlplane.billing.selectors import credit_balance
from tests.controlplane.factories import PlanFactory
from tests.controlplane.gateway.conftest import make_world, start_module_gateway, start_replica, wait_ready

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SENTENCES = ["What is the capital of France?", "Paris is the capital of France.", "a"]


@pytest.fixture(scope="module")
def encoder_replica(minilm_checkpoint):
    replica = start_replica(minilm_checkpoint, "minilm", max_model_len=None, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield replica
    finally:
        replica.kill()


@pytest.fixture(scope="module")
def embeddings_gateway(encoder_replica, database_url):
    server = start_module_gateway(database_url)
    yield server
    server.stop()


def _world(gateway, replica, **options):
    wait_ready(replica)
    return make_world(gateway, [replica], kind="embedding", **options)


def test_sdk_embeddings_equal_the_reference_and_are_billed_per_request(
    embeddings_gateway, encoder_replica, minilm_checkpoint
):
    world = _world(embeddings_gateway, encoder_replica)
    client = world.client()
    response = client.embeddings.with_raw_response.create(model=world.model.public_name, input=SENTENCES)
    result = response.parse()
    got = torch.tensor([d.embedding for d in result.data])
    tokenizer = AutoTokenizer.from_pretrained(minilm_checkpoint)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = BertModel.from_pretrained(minilm_checkpoint).eval()(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    reference = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert (1 - (got * reference).sum(-1)).abs().max().item() < 1e-5
    assert result.usage.prompt_tokens == int(batch["attention_mask"].sum())
    # The SDK asks for base64 by default when numpy is around and decodes it; ask for floats too.
    floats = client.embeddings.create(model=world.model.public_name, input="hello", encoding_format="float")
    b64 = client.embeddings.create(model=world.model.public_name, input="hello", encoding_format="base64")
    vector = np.frombuffer(__import__("base64").b64decode(b64.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(vector, floats.data[0].embedding, atol=1e-7)
    world.settled()
    record = UsageRecord.objects.get(request_id=response.headers["x-request-id"])
    assert (record.status, record.price_charged) == ("completed", Decimal("0.002"))
    assert credit_balance(tenant=world.tenant) == Decimal("10") - 3 * Decimal("0.002")


def test_wrong_kind_bad_input_and_limits(embeddings_gateway, encoder_replica):
    world = _world(
        embeddings_gateway, encoder_replica, plan=PlanFactory(rate_limit_per_minute=3, max_concurrent_requests=5)
    )
    client = world.client()
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=world.model.public_name, messages=[{"role": "user", "content": "hi"}])
    assert "/v1/embeddings" in chat.value.message
    with pytest.raises(openai.BadRequestError) as dims:
        client.embeddings.create(model=world.model.public_name, input="hi", dimensions=64)
    assert dims.value.body["param"] == "dimensions"  # the replica's refusal, relayed and not billed
    with pytest.raises(openai.BadRequestError) as empty:
        client.embeddings.create(model=world.model.public_name, input=[])
    assert empty.value.body["param"] == "input"
    with pytest.raises(openai.AuthenticationError):
        world.client(api_key="sk-wrong").embeddings.create(model=world.model.public_name, input="hi")
    client.embeddings.create(model=world.model.public_name, input="hi")
    with pytest.raises(openai.RateLimitError):  # 3 per minute: the 400s above counted as requests too
        for _ in range(3):
            client.embeddings.create(model=world.model.public_name, input="hi")
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() >= 1
    assert not UsageRecord.objects.filter(tenant=world.tenant).exclude(status="completed").exists()


def test_embeddings_on_a_chat_model_is_400(embeddings_gateway, encoder_replica):
    chat_world = make_world(embeddings_gateway, [encoder_replica])  # kind chat: refused before any replica
    with pytest.raises(openai.BadRequestError) as wrong:
        chat_world.client().embeddings.create(model=chat_world.model.public_name, input="hi")
    assert wrong.value.body["code"] == "wrong_model_kind"


def test_a_stream_is_a_400_naming_it_and_n_is_no_field_of_embeddings(embeddings_gateway, encoder_replica):
    world = _world(embeddings_gateway, encoder_replica)
    client = world.client()
    with pytest.raises(openai.BadRequestError) as streamed:
        client.embeddings.create(model=world.model.public_name, input="hi", extra_body={"stream": True})
    assert (streamed.value.param, streamed.value.type) == ("stream", "invalid_request_error")
    assert "stream" in streamed.value.message
    # n is not a field of the embeddings API: ignored like any other, the request is one request.
    for n in (3, -5, 100_000):
        response = client.embeddings.with_raw_response.create(
            model=world.model.public_name, input="hi", extra_body={"n": n}
        )
        assert len(response.parse().data) == 1
    world.settled()
    assert [(r.status, r.num_requests, r.price_charged) for r in UsageRecord.objects.filter(tenant=world.tenant)] == [
        ("completed", 1, Decimal("0.002"))
    ] * 3
    assert credit_balance(tenant=world.tenant) == Decimal("10") - 3 * Decimal("0.002")
