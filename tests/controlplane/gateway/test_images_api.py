"""Images in chat requests at the gateway: refused before routing for a model whose kind is not
vision (the replica's 400, naming the model), and beyond the catalog's image limits of a vision
model (naming the part); the image count reaches the request's usage record. The gateway app
runs in this process, against the test database and Redis; nothing is routed."""

import base64
import json
import os
from decimal import Decimal

import httpx
import pytest
import redis

from controlplane.gateway.app import build_app
from controlplane.gateway.body_check import check_body
from gpuworker.contract.openai_api import ChatCompletionRequest
from tests.conftest import require_service

PNG_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * 2000).decode()


def _chat(model: str, *urls: str) -> bytes:
    parts = [{"type": "text", "text": "what is it"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return json.dumps({"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 1}).encode()


def test_the_checked_body_carries_each_images_place_and_data_size():
    checked = check_body(_chat("m", PNG_URL, "https://x.test/a.png"), ChatCompletionRequest, 64, {})
    assert checked.error is None
    assert checked.image_params == ("messages.0.content.1.image_url", "messages.0.content.2.image_url")
    assert checked.image_sizes == (2004, None)
    bad = check_body(_chat("m", "gopher://x"), ChatCompletionRequest, 64, {})
    assert bad.error.param == "messages.0.content.1.image_url.url"


@pytest.fixture
def world(transactional_db, settings):
    from controlplane.billing.services import credit_grant
    from tests.controlplane.factories import ApiKeyFactory, ModelFactory, PlanFactory, TenantFactory

    url = os.environ.get("REDIS_URL", "")
    if not url:
        require_service("REDIS_URL is not set")
    redis.Redis.from_url(url).flushdb()
    settings.REDIS_URL, settings.FLEET_WORKER_TOKEN = url, "image-tests"
    tenant = TenantFactory(plan=PlanFactory(rate_limit_per_minute=10_000, max_concurrent_requests=100))
    credit_grant(tenant=tenant, amount=Decimal("10"))
    chat = ModelFactory(context_length=256)
    vision = ModelFactory(context_length=256, kind="vision", max_images_per_request=2, max_image_bytes=1000)
    return chat, vision, ApiKeyFactory(tenant=tenant)


async def _post(app, key, content: bytes) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        return await client.post(
            "/v1/chat/completions",
            content=content,
            timeout=60,
            headers={"Authorization": f"Bearer {key.plaintext}", "Content-Type": "application/json"},
        )


async def test_images_are_refused_before_routing_unless_the_model_is_vision_within_its_limits(world):
    chat, vision, key = world
    app = build_app()
    try:
        text_only = await _post(app, key, _chat(chat.public_name, PNG_URL))
        assert text_only.status_code == 400, text_only.text
        error = text_only.json()["error"]
        assert error["param"] == "model" and error["code"] == "model_not_multimodal"
        assert repr(chat.public_name) in error["message"]
        small = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * 100).decode()
        too_many = await _post(app, key, _chat(vision.public_name, small, small, small))
        assert too_many.status_code == 400, too_many.text
        assert too_many.json()["error"]["param"] == "messages.0.content.3.image_url"
        assert too_many.json()["error"]["code"] == "too_many_images"
        too_large = await _post(app, key, _chat(vision.public_name, small, PNG_URL))
        assert too_large.status_code == 400, too_large.text
        assert too_large.json()["error"]["param"] == "messages.0.content.2.image_url"
        assert "1000 bytes" in too_large.json()["error"]["message"]
    finally:
        await app.state.gateway.aclose()
