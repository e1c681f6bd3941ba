"""Where request bodies are parsed: small ones on the event loop, large ones in worker processes in
each tenant's turn, after the request was admitted against its key's limits; a token-id prompt
longer than the model's context is refused by its length. The gateway app runs in this process
(its event loop is the test's), against the test database and Redis."""

import asyncio
import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from controlplane.gateway import body_check
from controlplane.gateway.app import build_app
from controlplane.gateway.body_check import ModelLimits
from controlplane.gateway.body_parsing import BodyParsers
from controlplane.gateway.errors import GatewayError
from gpuworker.contract.openai_api import CompletionRequest, EmbeddingRequest
from tests.conftest import require_service
from tests.processes import children_running

REPO = Path(__file__).resolve().parents[3]
INLINE_BYTES = 64 * 1024
CONTEXT = 256


def fits(context_length: int) -> ModelLimits:
    """A model of this context whose body limit no body here reaches."""
    return ModelLimits(context_length, 1 << 30)


def _body(prompt, **fields) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **fields}, separators=(",", ":")).encode()


LARGE = _body([1] * 200_000)  # 400 kB of token ids, far past the inline limit


@pytest.fixture
def parsed_here(monkeypatch) -> list[int]:
    """The sizes of the bodies parsed in this process. Worker processes import body_check afresh,
    so what they parse is not recorded."""
    sizes: list[int] = []
    parse = body_check.parse_json_body

    def recording(raw: bytes) -> dict:
        sizes.append(len(raw))
        return parse(raw)

    monkeypatch.setattr(body_check, "parse_json_body", recording)
    return sizes


@pytest.fixture
async def parsers():
    parsers = BodyParsers(workers=2, per_tenant=1, inline_bytes=INLINE_BYTES, retry_after_s=1)
    yield parsers
    parsers.close()


async def test_large_bodies_are_parsed_in_a_worker_process_and_small_ones_here(parsers, parsed_here):
    small = _body([1] * 300)
    checked = await parsers.check(1, LARGE, CompletionRequest, 64, {"m": fits(CONTEXT)})
    assert parsed_here == []
    assert checked.error.code == "context_length_exceeded" and "200000 tokens" in checked.error.message
    checked = await parsers.check(1, small, CompletionRequest, 64, {"m": fits(CONTEXT)})
    assert parsed_here == [len(small)]
    assert checked.error.code == "context_length_exceeded" and "300 tokens" in checked.error.message


async def test_what_comes_back_from_a_worker_is_what_the_request_path_needs(parsers):
    streamed = await parsers.check(
        1, _body([7] * 30_000, stream=True, n=2), CompletionRequest, 64, {"m": fits(100_000)}
    )
    assert streamed.error is None and streamed.model == "m" and streamed.stream and streamed.n == 2
    assert streamed.affinity_key == json.dumps([7] * 64)[:64]
    upstream = json.loads(streamed.upstream_body)  # the replica must report usage
    assert upstream["stream_options"] == {"include_usage": True} and len(upstream["prompt"]) == 30_000
    whole = await parsers.check(1, _body("x" * 100_000), CompletionRequest, 64, {"m": fits(100_000)})
    assert whole.error is None and not whole.stream and whole.upstream_body is None
    garbage = await parsers.check(1, b"[" * 100_000, CompletionRequest, 64, {})
    assert garbage.json_error and garbage.model is None
    embeddings = json.dumps({"model": "e", "input": [[1] * (CONTEXT + 1)] + [[2] * 10] * 6000}).encode()
    refused = await parsers.check(1, embeddings, EmbeddingRequest, 64, {"e": fits(CONTEXT)})
    assert refused.error.code == "context_length_exceeded" and refused.error.param == "input"


async def test_a_tenant_has_at_most_its_turns_in_the_pool_while_another_tenants_bodies_are_parsed(parsers):
    one, other = 1, 2
    work = [
        asyncio.ensure_future(parsers.check(tenant, LARGE, CompletionRequest, 64, {"m": fits(CONTEXT)}))
        for tenant in (one, one, one, other)
    ]
    most_of_one, seen_other = 0, False
    while not all(task.done() for task in work):
        most_of_one = max(most_of_one, parsers.tenant_load(one)[0])
        seen_other = seen_other or parsers.tenant_load(other)[0] == 1
        await asyncio.sleep(0.005)
    assert most_of_one == 1 and seen_other
    assert [task.result().error.code for task in work] == ["context_length_exceeded"] * 4
    assert parsers.tenant_load(one) == parsers.tenant_load(other) == (0, 0)  # nothing kept per tenant


def test_a_parser_process_loads_none_of_djangos_models():
    """What a spawned parser imports (its start, body_check and the request schemas it unpickles)
    loads no Django model: without Django set up, one would kill every parser as it starts."""
    imports = "import controlplane.gateway.parser_process, controlplane.gateway.body_check, sys"
    report = "print(sorted(m for m in sys.modules if m.startswith(('django.db', 'controlplane')) and 'models' in m))"
    out = subprocess.run(
        [sys.executable, "-c", f"{imports}; {report}"],
        cwd=REPO,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": ""},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "[]"


async def test_a_parser_process_that_dies_costs_one_request_a_503_and_the_next_is_parsed(parsers):
    await parsers.check(1, LARGE, CompletionRequest, 64, {"m": fits(CONTEXT)})  # the pool is up
    for child in children_running("spawn_main"):  # the pool's workers (not multiprocessing's resource tracker)
        child.kill()
    with pytest.raises(GatewayError) as refused:
        for _ in range(3):  # the pool may take a moment to notice its loss; a request that reaches it first is served
            await parsers.check(1, LARGE, CompletionRequest, 64, {"m": fits(CONTEXT)})
    assert refused.value.status == 503 and refused.value.code == "parser_unavailable"
    checked = await parsers.check(1, LARGE, CompletionRequest, 64, {"m": fits(CONTEXT)})
    assert checked.error.code == "context_length_exceeded"


# --- through the gateway ------------------------------------------------------------------------


@pytest.fixture
def world(transactional_db, settings):
    from controlplane.billing.services import credit_grant
    from tests.controlplane.factories import ApiKeyFactory, ModelFactory, PlanFactory, TenantFactory

    url = os.environ.get("REDIS_URL", "")
    if not url:
        require_service("REDIS_URL is not set")
    redis.Redis.from_url(url).flushdb()
    settings.REDIS_URL, settings.FLEET_WORKER_TOKEN = url, "body-parsing-tests"
    settings.GATEWAY_INLINE_BODY_BYTES = INLINE_BYTES
    tenant = TenantFactory(plan=PlanFactory(rate_limit_per_minute=10_000, max_concurrent_requests=100))
    credit_grant(tenant=tenant, amount=Decimal("10"))
    model = ModelFactory(context_length=CONTEXT)
    keys = {
        "any": ApiKeyFactory(tenant=tenant),
        "one_a_minute": ApiKeyFactory(tenant=tenant, rate_limit_per_minute=1),
        "one_at_a_time": ApiKeyFactory(tenant=tenant, max_concurrent_requests=1),
    }
    return model, keys


async def _post(app, key, content: bytes) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        return await client.post(
            "/v1/completions",
            content=content,
            timeout=60,
            headers={"Authorization": f"Bearer {key.plaintext}", "Content-Type": "application/json"},
        )


def _prompt(model, ids: int) -> bytes:
    return json.dumps({"model": model.public_name, "prompt": [1] * ids}, separators=(",", ":")).encode()


async def test_through_the_gateway_a_long_token_prompt_is_a_400_naming_the_context_parsed_off_the_loop(
    world, parsed_here
):
    model, keys = world
    app = build_app()
    try:
        large, small = _prompt(model, 200_000), _prompt(model, CONTEXT)
        for content in (large, small):
            response = await _post(app, keys["any"], content)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
            assert f"context of {CONTEXT} tokens" in error["message"]
        assert parsed_here == [len(small)]
    finally:
        await app.state.gateway.aclose()


async def test_a_large_body_over_its_keys_rate_limit_is_a_429_before_it_is_parsed(world, parsed_here):
    model, keys = world
    app = build_app()
    try:
        first = await _post(app, keys["one_a_minute"], _prompt(model, 200_000))
        assert first.status_code == 400  # admitted, then refused by its length
        # Not even JSON: parsing it would say so (400); it is refused before that.
        refused = await _post(app, keys["one_a_minute"], b"{" * 200_000)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in refused.headers
    finally:
        await app.state.gateway.aclose()


async def test_a_large_body_over_its_keys_concurrency_is_a_429_and_a_refused_one_frees_its_slot(world):
    model, keys = world
    key = keys["one_at_a_time"]
    app = build_app()
    try:
        assert (await _post(app, key, _prompt(model, 200_000))).status_code == 400
        # Its slot was freed when it was refused: the next one is admitted and parsed.
        assert (await _post(app, key, _prompt(model, 200_000))).status_code == 400
        gateway = app.state.gateway
        grant = await gateway.keys.authenticate(f"Bearer {key.plaintext}")
        assert (await gateway.shared.admit(grant, "req_held")).allowed  # another request of the key in flight
        refused = await _post(app, key, b"{" * 200_000)
        assert refused.status_code == 429, refused.text
        assert "key concurrency: 1" in refused.json()["error"]["message"]
        await gateway.shared.finish("req_held", grant=grant)
        assert (await _post(app, key, _prompt(model, 200_000))).status_code == 400
    finally:
        await app.state.gateway.aclose()


def test_a_models_body_limit_follows_its_context_under_the_cap():
    from controlplane.gateway.body_check import check_body, model_request_bytes

    assert model_request_bytes(context_length=1000, cap=1 << 20, bytes_per_token=16, allowance=100) == 16_100
    assert model_request_bytes(context_length=1 << 20, cap=1 << 20, bytes_per_token=16, allowance=100) == 1 << 20
    # A vision model's images come on top, as base64.
    vision = model_request_bytes(context_length=1000, cap=1 << 30, bytes_per_token=16, allowance=100, image_bytes=3000)
    assert vision == 16_100 + 4000
    body = _body("x" * 500)
    refused = check_body(body, CompletionRequest, 64, {"m": ModelLimits(256, len(body) - 1)})
    assert refused.error.status == 413 and refused.error.code == "request_too_large"
    assert f"({len(body)} bytes) is larger than 'm' takes: {len(body) - 1} bytes" in refused.error.message
    assert check_body(body, CompletionRequest, 64, {"m": ModelLimits(256, len(body))}).error is None
    assert check_body(body, CompletionRequest, 64, {"other": ModelLimits(256, 1)}).error is None


@pytest.fixture
def long_context_model(world):
    from tests.controlplane.factories import ModelFactory

    return ModelFactory(context_length=100_000, price_tier=world[0].price_tier)


async def test_through_the_gateway_a_body_over_its_models_limit_is_a_413_that_follows_the_context(
    world, long_context_model, parsed_here, settings
):
    """The limit is the model's context times GATEWAY_REQUEST_BYTES_PER_TOKEN plus the allowance:
    the same large body is refused for a short-context model (checked off the event loop) and
    checked further for a long-context one."""
    settings.GATEWAY_REQUEST_BYTES_ALLOWANCE = 32 * 1024
    (short, keys), long = world, long_context_model
    app = build_app()
    try:
        response = await _post(app, keys["any"], _prompt(short, 200_000))
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "request_too_large"
        assert f"{32 * 1024 + CONTEXT * 16} bytes, for its context of {CONTEXT} tokens" in error["message"]
        response = await _post(app, keys["any"], _prompt(long, 200_000))
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert parsed_here == []  # both large bodies were parsed in worker processes
    finally:
        await app.state.gateway.aclose()


# A gateway process: Django set up (its errors reach billing's models), then a pool of parsers.
_GATEWAY_WITH_PARSERS = """
import asyncio, json, os
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django.setup()
from controlplane.gateway.body_parsing import BodyParsers
from gpuworker.contract.openai_api import CompletionRequest

async def main():
    parsers = BodyParsers(workers=2, per_tenant=1, inline_bytes=10, retry_after_s=1)
    await parsers.check(1, json.dumps({"model": "m", "prompt": [1] * 100}).encode(), CompletionRequest, 64, {})
    print("parsed", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_parser_processes_exit_with_a_gateway_killed_outright():
    gateway = subprocess.Popen(
        [sys.executable, "-c", _GATEWAY_WITH_PARSERS],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert gateway.stdout.readline() == b"parsed\n"
        parsers = children_running("spawn_main", gateway.pid)
        assert parsers
    finally:
        gateway.kill()
        gateway.wait()

    def running(process: psutil.Process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 60
    while any(running(parser) for parser in parsers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(parser) for parser in parsers)
