"""A mixture-of-experts model served through the gateway: a replica of a tiny random Qwen3-MoE
checkpoint behind it answers the `openai` SDK with the engine's greedy text (whose tokens equal
transformers', tests/gpuworker/engine/test_engine_greedy.py), billed per request like any other."""

from __future__ import annotations

import os
from decimal import Decimal

import pytest

from controlplane.billing.models import UsageRecord
from tests.controlplane.gateway.conftest import make_world, start_module_gateway, start_replica, wait_ready

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PROMPT = [5, 17, 200, 33, 8]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from tests.gpuworker.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("moe-checkpoint"), "qwen3-moe")


@pytest.fixture(scope="module")
def moe_replica(moe_checkpoint):
    replica = start_replica(moe_checkpoint, "tiny-moe", env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield replica
    finally:
        replica.kill()


@pytest.fixture(scope="module")
def moe_gateway(moe_replica, database_url):
    server = start_module_gateway(database_url)
    yield server
    server.stop()


def test_a_moe_replica_answers_the_sdk_with_the_reference_tokens(moe_gateway, moe_replica, moe_checkpoint):
    wait_ready(moe_replica)
    world = make_world(moe_gateway, [moe_replica])
    client = world.client()
    response = client.completions.with_raw_response.create(
        model=world.model.public_name, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True})
    completion = response.parse()
    assert completion.usage.completion_tokens == 8
    assert completion.choices[0].finish_reason == "length"
    from gpuworker.engine import LLMEngine, SamplingParams

    engine = LLMEngine(moe_checkpoint, device="cpu", dtype="float32", max_model_len=256)
    expected = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert completion.choices[0].text == expected.text
    world.settled()
    record = UsageRecord.objects.get(request_id=response.headers["x-request-id"])
    assert record.status == "completed" and record.price_charged > Decimal("0")
