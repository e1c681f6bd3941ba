"""The demo's chat model answers through the gateway: SmolLM2-135M-Instruct, prepared the way
`make run` prepares it (seed_demo's ensure_chat_model: its GGUF file copied into a model folder),
served by a replica and asked with the official `openai` SDK."""

from __future__ import annotations

import json

import pytest

from controlplane.demo import CHAT_MODEL_FILE, ensure_chat_model
from tests.controlplane.gateway.conftest import make_world, start_module_gateway, start_replica, wait_ready

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_replica(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "smollm2-135m-instruct"
    assert ensure_chat_model(folder)
    assert not ensure_chat_model(folder), "a second seed must reuse the copied file"
    assert [p.name for p in folder.iterdir()] == [CHAT_MODEL_FILE]
    replica = start_replica(folder, "smollm2")
    try:
        yield replica
    finally:
        replica.kill()


@pytest.fixture(scope="module")
def demo_gateway(smollm2_replica, database_url):
    server = start_module_gateway(database_url)
    yield server
    server.stop()


def test_the_demo_chat_model_knows_the_capital_of_france(demo_gateway, smollm2_replica):
    wait_ready(smollm2_replica)
    world = make_world(demo_gateway, [smollm2_replica])
    client = world.client(timeout=300)
    reply = client.chat.completions.create(model=world.model.public_name, messages=QUESTION,
                                           temperature=0, max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(model=world.model.public_name, messages=QUESTION,
                                            temperature=0, max_tokens=24, stream=True)
    assert "Paris" in "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    world.settled(30)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_the_demo_chat_model_makes_a_forced_tool_call(demo_gateway, smollm2_replica):
    # SmolLM2's template has no tools: the replica's fallback prompt and the arguments' grammar carry it.
    wait_ready(smollm2_replica)
    world = make_world(demo_gateway, [smollm2_replica])
    client = world.client(timeout=300)
    reply = client.chat.completions.create(
        model=world.model.public_name, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=40)  # the fallback prompt is ~210 of 256 tokens
    choice = reply.choices[0]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments.get("city"), str)
    world.settled(30)
