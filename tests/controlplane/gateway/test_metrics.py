"""The gateway's Prometheus metrics after real requests through the openai SDK: a gateway of two
uvicorn worker processes (as docker-compose runs it) with PROMETHEUS_MULTIPROC_DIR, so a scrape
answered by either process counts the requests both served."""

from decimal import Decimal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.controlplane.gateway.conftest import make_world, start_gateway, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHAT = [{"role": "user", "content": "Say hello."}]
TOKEN = "metrics-test-token"


@pytest.fixture
def two_process_gateway(gateway, database_url, tmp_path):
    server = start_gateway(
        database_url, gateway.redis_url, workers=2, METRICS_TOKEN=TOKEN, PROMETHEUS_MULTIPROC_DIR=str(tmp_path)
    )
    yield server
    server.stop()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_requests_latency_ttft_and_credits_are_counted_over_every_process(two_process_gateway, replicas):
    world = make_world(two_process_gateway, replicas)
    model = world.model.public_name
    client = world.client()
    for _ in range(3):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=3)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    with pytest.raises(openai.AuthenticationError):
        world.client(api_key="sk-wrong").chat.completions.create(model=model, messages=CHAT, max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=3)
    world.settled()

    # The settlements are written just after the answers: wait for their credits to be counted.
    credits = ("gpuserve_credits_charged_total", (("model", model),))
    wait_until(lambda: scrape(world.base_url).get(credits) == pytest.approx(0.008), 15, "the credits to be counted")
    samples = scrape(world.base_url)

    def requests(model_label: str, outcome: str, status: str, endpoint: str = "/v1/chat/completions") -> float:
        labels = (("endpoint", endpoint), ("model", model_label), ("outcome", outcome), ("status", status))
        return samples.get(("gpuserve_gateway_requests_total", labels), 0)

    assert requests(model, "completed", "200") == 4  # the stream counted when it ended
    # Refused before any model was known to be allowed: no model label (a key's guesses stay out).
    assert requests("", "rejected", "401") == 1
    assert requests("", "rejected", "404") == 1
    duration = dict(samples)
    assert duration[("gpuserve_gateway_request_duration_seconds_count", (("model", model),))] == 4
    assert duration[("gpuserve_gateway_request_duration_seconds_sum", (("model", model),))] > 0
    assert duration[("gpuserve_gateway_request_duration_seconds_bucket", (("le", "+Inf"), ("model", model)))] == 4
    # Time to first token: the streamed request's.
    assert duration[("gpuserve_gateway_time_to_first_token_seconds_count", (("model", model),))] == 1
    assert Decimal(str(samples[credits])) == Decimal("0.008")
    # The fleet's gauges come from the database: the world's two ready replicas.
    assert samples[("gpuserve_replicas", (("model", model), ("state", "ready")))] == 2
    assert samples[("gpuserve_replicas", (("model", model), ("state", "loading")))] == 0


def test_a_client_that_leaves_mid_stream_is_counted_as_cancelled(two_process_gateway, replicas):
    world = make_world(two_process_gateway, replicas)
    model = world.model.public_name
    stream = world.client().chat.completions.create(
        model=model, messages=CHAT, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    world.settled()
    labels = (("endpoint", "/v1/chat/completions"), ("model", model), ("outcome", "cancelled"), ("status", "200"))
    key = ("gpuserve_gateway_requests_total", labels)
    wait_until(lambda: scrape(world.base_url).get(key) == 1, 15, "the cancelled stream to be counted")
