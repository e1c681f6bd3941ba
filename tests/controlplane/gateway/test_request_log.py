"""The request log and per-key spend limits through the running gateway: a request made with the
openai SDK shows in the log with the figures the SDK saw, and a key's monthly limit refuses
concurrent requests exactly at the limit while another key of the tenant goes on."""

from decimal import Decimal

import openai
import pytest
from django.test import Client
from django.urls import reverse

from controlplane.accounts.models import User
from controlplane.billing.models import KeySpend, UsageRecord
from tests.controlplane.factories import ApiKeyFactory, UserFactory
from tests.controlplane.gateway.conftest import make_world

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "What is in the request log?"}]
PRICE = Decimal("0.002")


def _log_row(tenant, request_id: str) -> str:
    """The request's row of the request log page, as a member of its tenant reads it."""
    client = Client()
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    page = client.get(reverse("dashboard:requests")).content.decode()
    row = page[page.index(f'data-request-id="{request_id}"') :]
    return row[: row.index("</tr>")]


def test_the_request_log_shows_an_sdk_request_with_its_true_figures(gateway, replicas):
    world = make_world(gateway, replicas, price=PRICE)
    client = world.client()
    answer = client.chat.completions.with_raw_response.create(
        model=world.model.public_name, messages=CHAT, max_tokens=5, temperature=0
    )
    completion = answer.parse()
    with client.chat.completions.with_streaming_response.create(
        model=world.model.public_name, messages=CHAT, max_tokens=4, stream=True, stream_options={"include_usage": True}
    ) as streamed:
        stream_id = streamed.headers["x-request-id"]
        stream_usage = [chunk.usage for chunk in streamed.parse() if chunk.usage is not None][-1]
    world.settled()

    for request_id, usage in ((answer.headers["x-request-id"], completion.usage), (stream_id, stream_usage)):
        record = UsageRecord.objects.get(request_id=request_id)
        assert (record.prompt_tokens, record.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
        assert record.api_key_id == world.api_key.pk and record.outcome == "ok"
        assert 0 <= record.time_to_first_token_ms <= record.total_latency_ms and record.total_latency_ms > 0
        row = _log_row(world.tenant, request_id)
        for text in (
            f'data-field="prompt_tokens">{usage.prompt_tokens}<',
            f'data-field="completion_tokens">{usage.completion_tokens}<',
            f'data-field="ttft">{record.time_to_first_token_ms}<',
            f'data-field="latency">{record.total_latency_ms}<',
            ">ok</span>",
            f'data-field="cost">${PRICE}<',
            world.api_key.name,
            world.model.public_name,
        ):
            assert text in row, (text, row)
        # The SDK was told the same cost the log shows.
        assert Decimal(str(usage.model_extra["cost"])) == PRICE


def test_a_keys_monthly_limit_refuses_concurrent_requests_exactly_at_the_limit(gateway, replicas):
    """Twenty requests at once on a key with a budget for five: five are served and charged, fifteen
    refused with key_budget_exceeded; another key of the same tenant is not limited."""
    world = make_world(gateway, replicas, price=PRICE, monthly_spend_limit=PRICE * 5)
    other = ApiKeyFactory(tenant=world.tenant)
    outcomes = world.chats_at_once(20)
    assert outcomes.count("served") == 5 and outcomes.count("key_budget_exceeded") == 15
    assert world.chats_at_once(3, other.plaintext) == ["served"] * 3
    world.settled()
    assert KeySpend.objects.get(api_key=world.api_key).spent == PRICE * 5
    assert KeySpend.objects.get(api_key=other).spent == PRICE * 3
    assert UsageRecord.objects.filter(api_key=world.api_key).count() == 5
    with pytest.raises(openai.RateLimitError) as refused:  # spent now, not only held
        world.client().chat.completions.create(model=world.model.public_name, messages=CHAT, max_tokens=1)
    assert refused.value.code == "key_budget_exceeded" and "monthly spend limit ($0.01)" in refused.value.message
    assert refused.value.response.headers["x-should-retry"] == "false"
