"""A mixture-of-experts model served through the gateway: a replica of a tiny random Qwen3-MoE
checkpoint behind it answers the `openai` SDK with the engine's greedy text (whose tokens equal
transformers', tests/gpuworker/engine/test_engine_greedy.py), billed per request like any other."""

from __future__ import annotations

import os

import pytest

from tests.controlplane.gateway.conftest import (
    assert_answers_with_engine_text,
    make_world,
    start_module_gateway,
    start_replica,
    wait_ready,
)

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
    assert_answers_with_engine_text(make_world(moe_gateway, [moe_replica]), moe_checkpoint, PROMPT)
