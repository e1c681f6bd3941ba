"""A vision model served through the gateway: the official `openai` SDK sends a chat with a
data-URL image to a replica of a tiny random Qwen2.5-VL checkpoint and gets transformers' greedy
tokens for that chat and image, with the image's tokens in its usage, billed once per request with
the image counted in its usage record. The same replica serves a batch's image line and the
playground's attached image."""

from __future__ import annotations

import asyncio
import json
import os
from decimal import Decimal

import pytest

from tests.controlplane.dashboard.test_tenant_playground import in_process_gateway  # noqa: F401 (a fixture)
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


def _image_lines(model: str, png: bytes, count: int) -> bytes:
    lines = []
    for i in range(count):
        parts = [{"type": "text", "text": "what is in the picture"}]
        parts += [{"type": "image_url", "image_url": {"url": _data_url(png)}}] if i == 0 else []
        body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": MAX_TOKENS}
        lines.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _batch(world, raw: bytes):
    from django.utils import timezone

    from controlplane.batches.services import batch_create, batch_file_create

    file = batch_file_create(tenant_id=world.tenant.pk, filename="in.jsonl", purpose="batch", chunks=[raw])
    return batch_create(
        tenant_id=world.tenant.pk,
        api_key_id=world.api_key.pk,
        input_file=file,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
        now=timezone.now(),
    )


def test_a_batch_line_with_an_image_is_served_and_lines_past_the_limits_fail_the_batch_uncharged(
    vision_gateway, vision_replica, vision_checkpoint, settings, tmp_path
):
    """The batch runner (the Celery task's slice, run here) sends a vision model's image line to
    its replica and bills it once with its image counted; a file with a line over the catalog's
    image limits fails at validation, before anything is sent or charged."""
    from controlplane.batches import storage
    from controlplane.billing.models import CreditHold, UsageRecord
    from controlplane.gateway.batch_lines import run_batch
    from tests.controlplane.gateway.conftest import WORKER_TOKEN, _redis_url

    settings.BATCH_STORAGE_DIR, settings.FLEET_WORKER_TOKEN = str(tmp_path), WORKER_TOKEN
    settings.REDIS_URL, settings.BATCH_TASK_SLICE_SECONDS = _redis_url(), 120
    png = _png(90, 60, 1)
    _, prompt_len = _hf_answer(vision_checkpoint, [png])
    wait_ready(vision_replica)
    world = make_world(vision_gateway, [vision_replica], price=PRICE, kind="vision")
    world.model.max_images_per_request = 1
    world.model.save()
    batch = _batch(world, _image_lines(world.model.public_name, png, 2))
    assert asyncio.run(run_batch(batch.pk)) == "completed"
    batch.refresh_from_db()
    assert (batch.completed, batch.failed) == (2, 0)
    answers = {line["custom_id"]: line for line in map(json.loads, storage.read_lines(batch.output_file.storage_name))}
    usage = answers["line-0"]["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == prompt_len > answers["line-1"]["response"]["body"]["usage"]["prompt_tokens"]
    records = UsageRecord.objects.filter(request_id__startswith=f"{batch.public_id}:").order_by("request_id")
    assert [(r.batch, r.image_count, r.prompt_tokens) for r in records][0] == (True, 1, prompt_len)
    assert records.count() == 2
    # Two images where the catalog allows one: the file fails at validation, nothing is charged.
    line = json.loads(_image_lines(world.model.public_name, png, 1))
    line["body"]["messages"][0]["content"].append(line["body"]["messages"][0]["content"][1])
    refused = _batch(world, json.dumps(line).encode() + b"\n")
    assert asyncio.run(run_batch(refused.pk)) == "failed"
    refused.refresh_from_db()
    assert [(e["line"], e["param"], e["code"]) for e in refused.errors] == [
        (1, "body.messages.0.content.2.image_url", "too_many_images")
    ]
    assert not UsageRecord.objects.filter(request_id__startswith=f"{refused.public_id}:").exists()
    assert not CreditHold.objects.filter(tenant=world.tenant).exists()


def test_the_playground_sends_an_attached_image_to_a_vision_model(
    vision_gateway,
    vision_replica,
    vision_checkpoint,
    in_process_gateway,  # noqa: F811
):
    """The page's WebSocket (session auth, the form, the gateway's /v1 app in this process) sends
    the message with its image as a data: URL; the answer counts the image's tokens, the request's
    usage record its image, and the image field comes back empty with the message box."""
    from asgiref.sync import async_to_sync

    from controlplane.accounts.models import User
    from controlplane.billing.models import UsageRecord
    from tests.controlplane.dashboard.test_tenant_playground import (
        _close_gateway,
        _connect,
        _send,
        _session_cookie,
        _until_final,
    )
    from tests.controlplane.factories import UserFactory

    png = _png(90, 60, 1)
    _, prompt_len = _hf_answer(vision_checkpoint, [png])
    wait_ready(vision_replica)
    world = make_world(vision_gateway, [vision_replica], price=PRICE, kind="vision")
    cookie = _session_cookie(UserFactory(role=User.Role.TENANT_MEMBER, tenant=world.tenant))

    async def scenario():
        ws = await _connect(cookie)
        try:
            assert (await ws.connect())[0]
            fields = {"message": "what is in the picture", "system_prompt": "", "max_tokens": MAX_TOKENS}
            await ws.send_to(text_data=_send(world.model.public_name, image=_data_url(png), **fields))
            messages: list[str] = []
            final = await _until_final(ws, messages)
            return messages[0], final
        finally:
            await ws.disconnect(timeout=30)
            await _close_gateway(in_process_gateway)

    started, final = async_to_sync(scenario)()
    assert 'data-testid="playground-turn-image"' in started  # the transcript marks the image
    assert 'data-state="done"' in final and f"{prompt_len} prompt + {MAX_TOKENS} completion tokens" in final
    assert 'id="field-image" data-testid="playground-image" hx-swap-oob="true">' in final
    assert 'name="image" id="id_image" value=""' in final
    world.settled()
    [record] = UsageRecord.objects.filter(tenant=world.tenant)
    assert (record.status, record.image_count, record.prompt_tokens) == ("completed", 1, prompt_len)
