"""The playground end to end: the page's WebSocket consumer (through the project's ASGI routing,
session auth included) streams a chat answer from real CPU replicas through the gateway's /v1 app,
billed like an API request; Stop aborts the request on the replica. Also: a key revoked on the
keys page is refused by a running gateway.
"""

import html
import json
import re
import time
from decimal import Decimal

import httpx
import openai
import pytest
from asgiref.sync import async_to_sync
from django.test import Client
from django.urls import reverse

from controlplane.accounts.models import ApiKey, User
from controlplane.billing.models import CreditEntry, UsageRecord
from controlplane.gateway.app import process_app
from tests.controlplane.dashboard.websocket_client import WebSocketClient
from tests.controlplane.factories import PlanFactory, TenantFactory, UserFactory
from tests.controlplane.gateway.conftest import WORKER_TOKEN, make_world, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def in_process_gateway(settings):
    """The /v1 app of this (test) process, as the consumer uses it, configured for the replicas."""
    gateway_app = process_app()
    settings.FLEET_WORKER_TOKEN = WORKER_TOKEN
    settings.GATEWAY_ROUTING_REFRESH_MS = 100
    settings.GATEWAY_COLD_START_WAIT_SECONDS = 2
    gateway_app.state.gateway = None
    yield gateway_app
    assert gateway_app.state.gateway is None, "each scenario closes the gateway it used"


def _session_cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def _connect(user_cookie: bytes | None) -> WebSocketClient:
    from controlplane.asgi import application

    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if user_cookie:
        headers.append((b"cookie", user_cookie))
    return WebSocketClient(application, "/ws/playground/", headers=headers)


def _send(model: str, **fields) -> str:
    return json.dumps(
        {
            "action": "send",
            "model": model,
            "system_prompt": "You are terse.",
            "message": "Tell me a long story about GPUs.",
            "temperature": "0",
            "max_tokens": "40",
            "HEADERS": {"HX-Request": "true"},
            **{k: str(v) for k, v in fields.items()},
        }
    )


async def _until_final(ws: WebSocketClient, messages: list[str], timeout: float = 60) -> str:
    while True:
        message = await ws.receive_from(timeout=timeout)
        messages.append(message)
        if 'id="playground-status" data-state="' in message and 'data-state="streaming"' not in message:
            return message


async def _close_gateway(app) -> None:
    if app.state.gateway is not None:
        await app.state.gateway.aclose()
        app.state.gateway = None


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", headers={"Authorization": f"Bearer {WORKER_TOKEN}"}, timeout=5).json()


def _generated_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {WORKER_TOKEN}"}, timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total{")
    )


def test_answer_streams_and_is_billed_once(gateway, replicas, in_process_gateway):
    world = make_world(gateway, replicas, price=Decimal("0.003"))
    user = UserFactory(role=User.Role.TENANT_MEMBER, tenant=world.tenant)
    cookie = _session_cookie(user)

    async def scenario():
        ws = await _connect(cookie)
        try:
            connected, _ = await ws.connect()
            assert connected
            await ws.send_to(text_data=_send(world.model.public_name))
            messages: list[str] = []
            final = await _until_final(ws, messages)
        finally:
            await ws.disconnect(timeout=30)
            await _close_gateway(in_process_gateway)
        return messages, final

    messages, final = async_to_sync(scenario)()
    assert (
        'data-state="streaming"' in messages[0]
        and 'id="playground-send" data-testid="playground-send" disabled' in messages[0]
    )
    deltas = [m for m in messages if 'hx-swap-oob="beforeend"' in m]
    assert deltas, "the answer arrives as it streams, before the end"
    assert 'data-state="done"' in final and "cost $0.003." in final and "completion tokens" in final
    world.settled()
    record = UsageRecord.objects.get(tenant=world.tenant)
    assert record.status == UsageRecord.Status.COMPLETED and record.price_charged == Decimal("0.003")
    assert record.api_key.purpose == ApiKey.Purpose.PLAYGROUND and record.completion_tokens >= len(deltas)
    assert CreditEntry.objects.filter(tenant=world.tenant, kind=CreditEntry.Kind.USAGE).count() == 1
    # The session's key is gone with the session.
    assert ApiKey.objects.get(pk=record.api_key_id).revoked


def test_a_conversation_goes_on_with_the_turns_before_it(gateway, replicas, in_process_gateway):
    world = make_world(gateway, replicas)
    cookie = _session_cookie(UserFactory(role=User.Role.TENANT_MEMBER, tenant=world.tenant))

    async def scenario():
        ws = await _connect(cookie)
        try:
            assert (await ws.connect())[0]
            await ws.send_to(text_data=_send(world.model.public_name, message="First question", top_p="0.9"))
            first = await _until_final(ws, [])
            history = html.unescape(re.search(r'id="playground-history" value="([^"]*)"', first).group(1))
            messages: list[str] = []
            await ws.send_to(text_data=_send(world.model.public_name, message="Second question", history=history))
            second = await _until_final(ws, messages)
            await ws.send_to(text_data=json.dumps({"action": "clear", "HEADERS": {}}))
            cleared = await ws.receive_from(timeout=10)
            return first, history, messages[0], second, cleared
        finally:
            await ws.disconnect(timeout=30)
            await _close_gateway(in_process_gateway)

    first, history, started, second, cleared = async_to_sync(scenario)()
    assert 'data-state="done"' in first and 'data-state="done"' in second
    turns = json.loads(history)
    assert [t["role"] for t in turns] == ["user", "assistant"] and turns[0]["content"] == "First question"
    assert turns[1]["content"]  # the answer as the page showed it
    # The second answer starts with the conversation so far shown above it, and the message box emptied.
    assert started.count('data-testid="playground-turn"') == 3 and "First question" in started
    assert 'id="id_message"' in second and "Second question</textarea>" not in second
    assert len(json.loads(html.unescape(re.search(r'id="playground-history" value="([^"]*)"', second).group(1)))) == 4
    assert 'id="playground-history" value=""' in cleared and 'data-state="idle"' in cleared
    world.settled()
    # The second request carried the first turn: its prompt is longer by at least that turn.
    first_record, second_record = UsageRecord.objects.filter(tenant=world.tenant).order_by("created_at", "pk")
    assert second_record.prompt_tokens > first_record.prompt_tokens + first_record.completion_tokens


def test_stop_aborts_on_the_replica_and_bills_by_the_gateways_rules(gateway, replicas, in_process_gateway):
    world = make_world(gateway, replicas, price=Decimal("0.003"))
    user = UserFactory(role=User.Role.TENANT_MEMBER, tenant=world.tenant)
    cookie = _session_cookie(user)
    generated_before = sum(_generated_tokens(r.url) for r in replicas)
    max_tokens = 200

    async def scenario():
        ws = await _connect(cookie)
        try:
            assert (await ws.connect())[0]
            await ws.send_to(text_data=_send(world.model.public_name, max_tokens=max_tokens, message="Stop me."))
            messages = [await ws.receive_from(timeout=60)]
            while 'hx-swap-oob="beforeend"' not in messages[-1]:
                messages.append(await ws.receive_from(timeout=60))
            await ws.send_to(text_data=json.dumps({"action": "stop", "HEADERS": {}}))
            final = await _until_final(ws, messages)
            # The socket stays usable: the session key is still good for the next question.
            return messages, final
        finally:
            await ws.disconnect(timeout=30)
            await _close_gateway(in_process_gateway)

    messages, final = async_to_sync(scenario)()
    assert 'data-state="stopped"' in final, final
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = [_stats(r.url) for r in replicas]
        if all(s["running"] == 0 and s["waiting"] == 0 and s["in_flight"] == 0 for s in stats):
            break
        time.sleep(0.05)
    assert all(s["running"] == 0 and s["in_flight"] == 0 for s in stats), stats
    generated = sum(_generated_tokens(r.url) for r in replicas) - generated_before
    assert generated < max_tokens, "aborted on the replica, not run to the end"
    world.settled()
    record = UsageRecord.objects.get(tenant=world.tenant)
    # Stopped after its first token: charged once, as cancelled.
    assert record.status == UsageRecord.Status.CANCELLED and record.price_charged == Decimal("0.003")
    assert CreditEntry.objects.filter(tenant=world.tenant, kind=CreditEntry.Kind.USAGE).count() == 1


def test_errors_show_in_the_page(gateway, replicas, in_process_gateway):
    world = make_world(gateway, replicas)
    broke = TenantFactory(plan=PlanFactory(included_requests_per_month=0, rate_limit_per_minute=100))
    user = UserFactory(role=User.Role.TENANT_MEMBER, tenant=broke)
    cookie = _session_cookie(user)

    async def scenario():
        ws = await _connect(cookie)
        try:
            assert (await ws.connect())[0]
            await ws.send_to(text_data=_send(world.model.public_name))
            no_credit = await _until_final(ws, [])
            await ws.send_to(text_data=_send("no-such-model", max_tokens=0, message=" "))
            invalid = await ws.receive_from(timeout=10)
            return no_credit, invalid
        finally:
            await ws.disconnect(timeout=30)
            await _close_gateway(in_process_gateway)

    no_credit, invalid = async_to_sync(scenario)()
    assert 'data-state="failed"' in no_credit and 'data-code="insufficient_quota"' in no_credit
    assert "run out of credits" in no_credit
    assert 'id="error-model"' in invalid and "Select a valid choice" in invalid
    assert "Write a message to send" in invalid or "This field is required" in invalid
    assert "greater than or equal to 1" in invalid
    assert not UsageRecord.objects.filter(tenant=broke).exists()


@pytest.mark.parametrize(("role", "may_connect"), [(None, False), (User.Role.OPERATOR, True), (User.Role.ADMIN, True)])
def test_tenant_members_operators_and_admins_may_connect(role, may_connect, in_process_gateway):
    cookie = None if role is None else _session_cookie(UserFactory(role=role, tenant=None))

    async def scenario():
        ws = await _connect(cookie)
        connected, code = await ws.connect()
        await ws.disconnect(timeout=30)
        return connected, code

    connected, code = async_to_sync(scenario)()
    assert connected == may_connect and (may_connect or code == 4403)


def test_a_key_revoked_on_the_page_is_refused_by_the_gateway(gateway, replicas):
    world = make_world(gateway, replicas)
    client = Client()
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=world.tenant))
    page = client.post(reverse("dashboard:keys"), {"name": "to revoke"}).content.decode()
    start = page.index('id="key-plaintext"')
    plaintext = page[page.index(">", start) + 1 : page.index("</code>", start)]
    api = world.client(api_key=plaintext)
    answer = api.chat.completions.create(
        model=world.model.public_name, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices  # the gateway now holds the key in its cache
    api_key = ApiKey.objects.get(tenant=world.tenant, name="to revoke")
    assert (
        client.post(reverse("dashboard:key_revoke", args=[api_key.pk]), headers={"HX-Request": "true"}).status_code
        == 200
    )

    def refused() -> bool:
        try:
            api.models.list()
        except openai.AuthenticationError as error:
            return "revoked" in str(error)
        return False

    wait_until(refused, 5, "the gateway to refuse the revoked key")
    world.settled()
