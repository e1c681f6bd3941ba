"""The gateway without Redis (the embedded `make run` set-up): its in-process shared state serves
the same API, limits and billing through the official SDK."""

from decimal import Decimal

import openai
import pytest

from controlplane.billing.models import UsageRecord
from tests.controlplane.gateway.conftest import make_world, start_gateway

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture(scope="module")
def embedded_gateway(replica_processes, database_url, tmp_path_factory):
    server = start_gateway(database_url, "", VAR_DIR=str(tmp_path_factory.mktemp("var")))
    yield server
    server.stop()


def test_chat_limits_and_billing_without_redis(embedded_gateway, replicas):
    world = make_world(embedded_gateway, replicas, rate_limit_per_minute=2)
    client = world.client()
    ask = dict(model=world.model.public_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    chat = client.chat.completions.create(**ask)
    assert chat.usage.model_extra["cost"] == 0.002
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_extra["cost"] == 0.002
    with pytest.raises(openai.RateLimitError) as error:
        client.chat.completions.create(**ask)
    assert error.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    world.settled()
    assert sorted(UsageRecord.objects.values_list("status", "price_charged")) == [
        ("completed", Decimal("0.002")),
        ("completed", Decimal("0.002")),
    ]
