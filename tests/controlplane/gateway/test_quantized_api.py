"""Quantized checkpoints served through the gateway: a replica of a tiny AWQ and of a tiny FP8
(static activation scales) checkpoint answers the `openai` SDK with the engine's greedy text (whose
tokens equal transformers' on the dequantised weights, tests/gpuworker/engine/test_engine_quantized.py),
billed per request like any other."""

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


@pytest.fixture(scope="module", params=["awq", "fp8-vllm-static"])
def quantized_checkpoint(request, tmp_path_factory):
    from tests.gpuworker.quantized_checkpoints import make_quantized_checkpoint

    return make_quantized_checkpoint(tmp_path_factory.mktemp("quantized"), request.param)[0]


@pytest.fixture(scope="module")
def quantized_replica(quantized_checkpoint):
    replica = start_replica(quantized_checkpoint, "tiny-quantized", env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield replica
    finally:
        replica.kill()


@pytest.fixture(scope="module")
def quantized_gateway(quantized_replica, database_url):
    server = start_module_gateway(database_url)
    yield server
    server.stop()


def test_a_quantized_replica_answers_the_sdk_with_the_engine_tokens(
    quantized_gateway, quantized_replica, quantized_checkpoint
):
    wait_ready(quantized_replica)
    assert_answers_with_engine_text(make_world(quantized_gateway, [quantized_replica]), quantized_checkpoint, PROMPT)
