"""A vision model served through the gateway: the official `openai` SDK sends a chat with a
data-URL image to a replica of a tiny random Qwen2.5-VL checkpoint and gets transformers' greedy
tokens for that chat and image, with the image's tokens in its usage, billed once per request with
the image counted in its usage record."""

from __future__ import annotations

import os
from decimal import Decimal

import pytest

from tests.controlplane.gateway.conftest import make_world, start_module_gateway, start_replica, wait_ready
from tests.gpuworker.replica.test_app_vision import _data_url, _hf_answer, _png

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MAX_TOKENS = 6
PRICE = Decimal("0.002")


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    from tests.gpuworker.models.vision_checkpoints import make_qwen2_5_vl

    return make_qwen2_5_vl(tmp_path_factory.mktemp("vision-checkpoint"))


@pytest.fixture(scope="module")
def vision_replica(vision_checkpoint):
    replica = start_replica(vision_checkpoint, "tiny-vl", env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield replica
    finally:
        replica.kill()


@pytest.fixture(scope="module")
def vision_gateway(vision_replica, database_url):
    server = start_module_gateway(database_url)
    yield server
    server.stop()


def test_the_sdk_sends_an_image_through_the_gateway_and_is_billed_once(
    vision_gateway, vision_replica, vision_checkpoint
):
    from controlplane.billing.models import UsageRecord

    png = _png(90, 60, 1)
    expected, prompt_len = _hf_answer(vision_checkpoint, [png])
    _, text_len = _hf_answer(vision_checkpoint, [])
    wait_ready(vision_replica)
    world = make_world(vision_gateway, [vision_replica], price=PRICE, kind="vision")
    parts = [
        {"type": "text", "text": "what is in the picture"},
        {"type": "image_url", "image_url": {"url": _data_url(png)}},
    ]
    response = world.client().chat.completions.with_raw_response.create(
        model=world.model.public_name,
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    chat = response.parse()
    assert [entry.token for entry in chat.choices[0].logprobs.content] == expected  # transformers' tokens
    assert chat.usage.prompt_tokens == prompt_len > text_len + 3  # the image's tokens are counted
    world.settled()
    [record] = UsageRecord.objects.filter(request_id=response.headers["x-request-id"])
    assert (record.status, record.price_charged, record.image_count) == ("completed", PRICE, 1)
    assert (record.prompt_tokens, record.completion_tokens) == (prompt_len, MAX_TOKENS)
