"""The demo's chat model answers through the gateway: SmolLM2-135M-Instruct, prepared the way
`make run` prepares it (seed_demo's ensure_chat_model: its GGUF file copied into a model folder),
served by a replica and asked with the official `openai` SDK."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from controlplane.demo.seed import CHAT_MODEL_FILE, ensure_chat_model
from tests.controlplane.gateway.conftest import make_world, start_module_gateway, start_replica, wait_ready

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_replica(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "smollm2-135m-instruct"
    assert ensure_chat_model(folder)
    assert not ensure_chat_model(folder), "a second seed must reuse the copied file"
    assert [p.name for p in folder.iterdir()] == [CHAT_MODEL_FILE]
    # Room for instructor's prompts, which carry the response model's JSON schema.
    replica = start_replica(folder, "smollm2", max_model_len=1024)
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
    reply = client.chat.completions.create(
        model=world.model.public_name, messages=QUESTION, temperature=0, max_tokens=24
    )
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(
        model=world.model.public_name, messages=QUESTION, temperature=0, max_tokens=24, stream=True
    )
    assert "Paris" in "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    world.settled(30)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


PARIS_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _weather_call(choice) -> tuple:
    """The choice's one call, get_weather with a string city: the call and its parsed arguments."""
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments.get("city"), str)
    return call, arguments


def test_the_demo_chat_model_makes_a_forced_tool_call(demo_gateway, smollm2_replica):
    # SmolLM2's template has no tools: the replica's fallback prompt and the arguments' grammar carry it.
    wait_ready(smollm2_replica)
    world = make_world(demo_gateway, [smollm2_replica])
    client = world.client(timeout=300)
    reply = client.chat.completions.create(
        model=world.model.public_name,
        messages=PARIS_WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
    )
    _weather_call(reply.choices[0])
    world.settled(30)


def test_a_required_call_cut_by_max_tokens_leaks_no_markup(demo_gateway, smollm2_replica):
    # With parallel calls allowed, SmolLM2 repeats its call until max_tokens: the call cut short
    # comes back as far as it got, and no piece of its markup (a "</tool_call" cut in two) as content.
    wait_ready(smollm2_replica)
    world = make_world(demo_gateway, [smollm2_replica])
    client = world.client(timeout=300)
    for max_tokens in (60, 61, 62, 63):
        reply = client.chat.completions.create(
            model=world.model.public_name,
            messages=PARIS_WEATHER,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            temperature=0,
            max_tokens=max_tokens,
        )
        choice = reply.choices[0]
        assert choice.message.content is None, (max_tokens, choice.message.content)
        assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
        stream = client.chat.completions.create(
            model=world.model.public_name,
            messages=PARIS_WEATHER,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
        )
        chunks = list(stream)
        assert not any(c.choices and c.choices[0].delta.content for c in chunks), max_tokens
    world.settled(30)


def test_the_demo_chat_model_calls_a_tool_when_it_may_choose(demo_gateway, smollm2_replica):
    # tool_choice "auto" on a template without tools: the generic format (one JSON object, a call
    # or the response), which the replica turns into OpenAI's tool calls.
    wait_ready(smollm2_replica)
    world = make_world(demo_gateway, [smollm2_replica])
    client = world.client(timeout=300)
    reply = client.chat.completions.create(
        model=world.model.public_name, messages=PARIS_WEATHER, tools=[WEATHER_TOOL], temperature=0, max_tokens=60
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, arguments = _weather_call(choice)
    assert call.id.startswith("call_") and set(arguments) == {"city"}

    stream = client.chat.completions.create(
        model=world.model.public_name,
        messages=PARIS_WEATHER,
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)  # no wrapper, no text
    deltas = [d for chunk in chunks for d in (chunk.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert rest and all(d.index == 0 and d.id is None for d in rest)
    assert json.loads("".join(d.function.arguments for d in rest)) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    world.settled(30)


# SmolLM2-135M over-calls (asked the capital of France or told "Hello!", it calls get_weather);
# asked for a poem, it answers, and the answer arrives as plain content.
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


def test_the_demo_chat_model_answers_in_text_when_it_may_call(demo_gateway, smollm2_replica):
    wait_ready(smollm2_replica)
    world = make_world(demo_gateway, [smollm2_replica])
    client = world.client(timeout=300)
    reply = client.chat.completions.create(
        model=world.model.public_name, messages=POEM, tools=[WEATHER_TOOL], temperature=0, max_tokens=30
    )
    choice = reply.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    text = choice.message.content
    assert "sea" in text.lower() and not text.lstrip().startswith("{") and '"response"' not in text
    stream = client.chat.completions.create(
        model=world.model.public_name, messages=POEM, tools=[WEATHER_TOOL], temperature=0, max_tokens=30, stream=True
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    assert not any(chunk.choices[0].delta.tool_calls for chunk in chunks)
    world.settled(30)


class City(BaseModel):
    name: str
    country: str


CITY_MESSAGES = [{"role": "user", "content": "Paris is the capital of France. Extract the city and its country."}]


# JSON_SCHEMA and TOOLS send the schema, which the grammar enforces: asked plainly, SmolLM2-135M
# fills it in.
@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_gets_a_parsed_object_from_the_demo_chat_model(demo_gateway, smollm2_replica, mode):
    _assert_instructor_extracts_paris(demo_gateway, smollm2_replica, mode, CITY_MESSAGES)


def _assert_instructor_extracts_paris(demo_gateway, replica, mode: str, messages: list[dict]) -> None:
    # Installed by `make install-dev` (with --no-deps: see the Makefile); imported here so that the
    # other tests of the module run without it.
    import instructor

    wait_ready(replica)
    world = make_world(demo_gateway, [replica])
    client = instructor.from_openai(world.client(timeout=300), mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(
        model=world.model.public_name,
        messages=messages,
        response_model=City,
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )
    assert isinstance(city, City)
    assert city.name == "Paris" and city.country.lower() == "france"
    world.settled(30)


# One earlier exchange that shows the shape of the answer. JSON and MD_JSON modes send no schema to
# the server (JSON asks for any JSON object, MD_JSON for nothing): the schema is only text in
# instructor's system message, and asked plainly (CITY_MESSAGES) SmolLM2-135M writes that schema
# back with the values in its titles ({"properties": {"name": {"title": "Paris", ...}}}), in JSON
# mode and in a ```json block alike. Shown one answer, it writes an instance, as users of small
# models prompt them.
CITY_MESSAGES_WITH_AN_EXAMPLE = [
    {"role": "user", "content": "Rome is the capital of Italy. Extract the city and its country."},
    {"role": "assistant", "content": '```json\n{"name": "Rome", "country": "Italy"}\n```'},
    *CITY_MESSAGES,
]


@pytest.mark.parametrize("mode", ["JSON", "MD_JSON"])
def test_instructor_gets_a_parsed_object_without_a_schema_on_the_server(demo_gateway, smollm2_replica, mode):
    _assert_instructor_extracts_paris(demo_gateway, smollm2_replica, mode, CITY_MESSAGES_WITH_AN_EXAMPLE)


def test_an_openai_agents_sdk_agent_uses_a_tool_through_the_responses_api(demo_gateway, smollm2_replica):
    # The Agents SDK speaks the Responses API: the turn must call the tool, whose answer ends the
    # run (asked again with tool_choice auto, SmolLM2 keeps calling it: the loop would not end).
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    wait_ready(smollm2_replica)
    world = make_world(demo_gateway, [smollm2_replica])
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return "Sunny and 21 degrees."

    async def run():
        agent = Agent(
            name="weather",
            instructions="You answer questions about the weather.",
            model=OpenAIResponsesModel(model=world.model.public_name, openai_client=world.async_client(timeout=300)),
            tools=[get_weather],
            model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60),
            tool_use_behavior="stop_on_first_tool",
        )
        return await Runner.run(
            agent, "What is the weather in Paris?", max_turns=4, run_config=RunConfig(tracing_disabled=True)
        )

    result = asyncio.run(run())
    assert len(cities) == 1 and "Paris" in cities[0] and result.final_output == "Sunny and 21 degrees."
    world.settled(30)
