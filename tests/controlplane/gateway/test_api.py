"""The public API end to end through the official `openai` SDK: models, chat and completions,
streaming with usage, and what each request is billed."""

from decimal import Decimal

import httpx
import openai
import pytest

from controlplane.accounts.models import ApiKey
from controlplane.billing.models import CreditEntry, UsageRecord
from controlplane.billing.selectors import credit_balance
from tests.controlplane.gateway.conftest import make_world, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def world(gateway, replicas):
    return make_world(gateway, replicas)


def test_models_lists_what_the_key_may_use_and_can_answer(gateway, replicas):
    from tests.controlplane.factories import DeploymentFactory, ModelFactory

    world = make_world(gateway, replicas)
    # No replica, and no online worker with room to start one (test_cold_start has the rest).
    cold = DeploymentFactory(keep_warm=True, model=ModelFactory()).model
    client = world.client()
    listed = {m.id: m for m in client.models.list()}
    assert world.model.public_name in listed
    assert cold.public_name not in listed
    assert listed[world.model.public_name].object == "model"
    assert client.models.retrieve(world.model.public_name).id == world.model.public_name


def test_chat_completion_is_answered_and_billed_once(world):
    client = world.client()
    response = client.chat.completions.with_raw_response.create(
        model=world.model.public_name,
        messages=CHAT,
        max_tokens=4,
        n=2,
        seed=7,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        stop=["\n\n"],
        user="alice",
        logprobs=True,
        top_logprobs=2,
    )
    request_id = response.headers["x-request-id"]
    chat = response.parse()
    assert chat.object == "chat.completion" and chat.model == world.model.public_name
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    assert chat.usage.completion_tokens > 0
    # n choices cost n requests.
    assert Decimal(str(chat.usage.model_extra["cost"])) == Decimal("0.004")
    world.settled()
    record = UsageRecord.objects.get(request_id=request_id)
    assert (record.status, record.price_charged, record.num_requests) == ("completed", Decimal("0.004"), 2)
    assert record.prompt_tokens == chat.usage.prompt_tokens and record.gpu_time_s > 0
    # The GPU seconds the replica's engine measured for the request, as its usage reported them.
    assert record.gpu_time_s == chat.usage.model_extra["gpu_time_s"]
    assert record.replica_id in {r.pk for r in world.replicas} and record.api_key_id == world.api_key.pk
    assert credit_balance(tenant=world.tenant) == Decimal("10") - Decimal("0.004")
    # The key's last use is recorded (at most once a minute), off the request's path.
    wait_until(lambda: ApiKey.objects.get(pk=world.api_key.pk).last_used_at is not None, 5, "last_used_at")


def test_text_completion_with_max_completion_fields(world):
    client = world.client()
    completion = client.completions.create(
        model=world.model.public_name,
        prompt="Once upon a time",
        max_tokens=3,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    assert completion.object == "text_completion"
    assert completion.usage.completion_tokens == 3 and completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=world.model.public_name, messages=CHAT, max_completion_tokens=2, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 2


def test_streaming_chat_with_usage(world):
    client = world.client()
    with client.chat.completions.with_streaming_response.create(
        model=world.model.public_name,
        messages=CHAT,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ) as response:
        request_id = response.headers["x-request-id"]
        chunks = list(response.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.model == world.model.public_name for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 5
    assert Decimal(str(usage.model_extra["cost"])) == Decimal("0.002")
    world.settled()
    record = UsageRecord.objects.get(request_id=request_id)
    assert (record.status, record.completion_tokens, record.price_charged) == ("completed", 5, Decimal("0.002"))
    assert record.time_to_first_token_ms is not None and record.time_to_first_token_ms <= record.total_latency_ms


def test_streaming_completion_without_usage_has_none(world):
    stream = world.client().completions.create(
        model=world.model.public_name, prompt="abc", max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() == 1


def test_logit_bias_steers_chat_and_completions_streamed_or_not(world, checkpoint):
    from transformers import AutoTokenizer

    [z] = AutoTokenizer.from_pretrained(checkpoint).encode("z", add_special_tokens=False)
    client, model = world.client(), world.model.public_name
    common = {"model": model, "max_tokens": 3, "logit_bias": {str(z): 100}, "extra_body": {"ignore_eos": True}}
    assert client.completions.create(prompt="abc", **common).choices[0].text == "zzz"
    assert client.chat.completions.create(messages=CHAT, **common).choices[0].message.content == "zzz"
    streamed = client.chat.completions.create(messages=CHAT, stream=True, **common)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "zzz"
    streamed = client.completions.create(prompt="abc", stream=True, **common)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "zzz"
    # best_of equal to n is n; best_of beyond n is refused before any replica is asked.
    assert len(client.completions.create(model=model, prompt="abc", n=2, best_of=2, max_tokens=2).choices) == 2
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="abc", n=1, best_of=3, max_tokens=2)
    assert refused.value.param == "best_of"
    world.settled()
    assert UsageRecord.objects.filter(tenant=world.tenant, status="completed").count() == 5


def test_every_response_has_a_request_id(world):
    ok = httpx.get(f"{world.base_url}/v1/models", headers={"Authorization": f"Bearer {world.api_key.plaintext}"})
    missing = httpx.post(f"{world.base_url}/v1/chat/completions", json={})
    unknown = httpx.get(f"{world.base_url}/v1/nothing-here")
    assert all(r.headers["x-request-id"].startswith("req_") for r in (ok, missing, unknown))
    assert unknown.status_code == 404 and unknown.json()["error"]["message"]


def test_ledger_equals_usage_after_mixed_traffic(world):
    client = world.client()
    for n in (1, 2, 3):
        client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2, n=n)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=2, n=99)
    world.settled()
    charged = sum(UsageRecord.objects.filter(tenant=world.tenant).values_list("price_charged", flat=True))
    debited = -sum(CreditEntry.objects.filter(tenant=world.tenant, kind="usage").values_list("amount", flat=True))
    assert charged == debited == Decimal("0.012")
    assert credit_balance(tenant=world.tenant) == Decimal("10") - charged


def test_a_repeated_conversation_is_billed_with_its_cached_prompt_and_reported_by_its_replica(world):
    """The second turn of a conversation lands on the replica that served the first (prefix
    affinity), its usage and record count the prompt tokens served from the prefix cache, and that
    replica's stats name the conversation by the digest the gateway sends it."""
    from controlplane.gateway.replica_choice import affinity_key
    from gpuworker.contract.prefix_keys import prefix_key_digest
    from tests.controlplane.gateway.conftest import AFFINITY_PREFIX_CHARS, WORKER_TOKEN

    messages = [{"role": "user", "content": "Summarise what a paged KV cache keeps per block, please. " * 3}]
    client = world.client()
    responses = [
        client.chat.completions.with_raw_response.create(
            model=world.model.public_name, messages=messages, max_tokens=2, temperature=0.0
        )
        for _ in range(2)
    ]
    world.settled()
    first, second = (UsageRecord.objects.get(request_id=r.headers["x-request-id"]) for r in responses)
    assert first.replica_id == second.replica_id
    usage = responses[1].parse().usage
    assert second.cached_prompt_tokens == usage.prompt_tokens_details.cached_tokens > 0
    assert first.cached_prompt_tokens == 0
    digest = prefix_key_digest(affinity_key({"messages": messages}, True, AFFINITY_PREFIX_CHARS))
    [replica] = [r for r in world.replicas if r.pk == second.replica_id]
    stats = httpx.get(f"{replica.endpoint_url}/stats", headers={"Authorization": f"Bearer {WORKER_TOKEN}"}).json()
    assert digest in stats["prefix_keys"]
