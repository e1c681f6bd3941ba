"""The playground's parts that need no replica: the form's conversation and parameters, the delta
batching that keeps the page up with the stream, and the "view code" samples."""

import asyncio
import base64
import json
import shlex

import pytest
from django.urls import reverse

from controlplane.accounts.models import User
from controlplane.dashboard.tenant.playground import DeltaBatcher, PlaygroundForm, PlaygroundPrompt
from controlplane.dashboard.tenant.playground_code import code_samples
from tests.controlplane.factories import ModelFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


def _form(**fields) -> PlaygroundForm:
    ModelFactory(public_name="chat-a", context_length=512)
    return PlaygroundForm({"model": "chat-a", "message": "Next?", "temperature": "0.5", "max_tokens": "16", **fields})


def test_the_form_sends_the_conversation_after_the_system_prompt_and_before_the_message():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    form = _form(system_prompt="Be brief.", history=json.dumps(history), top_p="0.9")
    assert form.is_valid(), form.errors
    body = form.prompt().chat_body()
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        *history,
        {"role": "user", "content": "Next?"},
    ]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["stream"]) == (0.5, 0.9, 16, True)


def test_an_empty_top_p_and_history_are_the_defaults():
    form = _form(top_p="", history="")
    assert form.is_valid(), form.errors
    prompt = form.prompt()
    assert (prompt.top_p, prompt.history) == (1.0, ())


def test_max_tokens_is_bounded_by_the_context_the_model_is_served_with():
    ModelFactory(public_name="extended", context_length=512, max_model_len=4096, allow_long_context=True)
    values = {"model": "extended", "message": "Next?", "temperature": "0.5"}
    assert PlaygroundForm({**values, "max_tokens": "2048"}).is_valid()
    form = PlaygroundForm({**values, "max_tokens": "4096"})
    assert not form.is_valid()
    assert "At most 4095 for extended (its context is 4096 tokens)." in form.errors["max_tokens"]


@pytest.mark.parametrize(
    ("history", "error"),
    [
        ("not json", "Enter a valid JSON"),
        (json.dumps({"role": "user"}), "must be a list"),
        (json.dumps([{"role": "system", "content": "sneaky"}]), "not a user or assistant message"),
        (json.dumps([{"role": "user", "content": 3}]), "not a user or assistant message"),
        (json.dumps([{"role": "user", "content": "x", "name": "y"}]), "not a user or assistant message"),
        (json.dumps([{"role": "user", "content": "x"}] * 101), "at most 100 messages"),
    ],
)
def test_a_malformed_conversation_is_refused_with_a_reason(history, error):
    form = _form(history=history)
    assert not form.is_valid()
    assert error in " ".join(form.errors["history"])


def test_top_p_out_of_range_is_refused():
    form = _form(top_p="1.5")
    assert not form.is_valid() and "less than or equal to 1" in " ".join(form.errors["top_p"])


def test_the_delta_batcher_sends_the_first_delta_at_once_and_joins_the_rest_in_order():
    async def scenario():
        sent: list[str] = []

        async def send(text: str) -> None:
            sent.append(text)

        batcher = DeltaBatcher(send, interval=3600)  # nothing but the first goes before the flush
        batcher.add("Hel")
        await asyncio.sleep(0)  # the first send runs
        for text in ("lo", ", ", "world"):
            batcher.add(text)
        await asyncio.sleep(0)
        assert sent == ["Hel"]
        await batcher.flush()
        return sent

    assert asyncio.run(scenario()) == ["Hel", "lo, world"]


def test_the_delta_batcher_sends_text_added_during_a_send_without_another_add():
    async def scenario():
        sent: list[str] = []
        release = asyncio.Event()

        async def slow_send(text: str) -> None:
            sent.append(text)
            await release.wait()

        batcher = DeltaBatcher(slow_send, interval=0)
        batcher.add("a")
        await asyncio.sleep(0)
        batcher.add("b")  # while "a" is still being sent
        batcher.add("c")
        release.set()
        await batcher.flush()
        return sent

    assert asyncio.run(scenario()) == ["a", "bc"]


def _prompt(**fields) -> PlaygroundPrompt:
    values = {
        "model": "chat-a",
        "system_prompt": "Be brief.",
        "message": 'It\'s "quoted" — ok?',
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 64,
        "history": ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}),
    }
    return PlaygroundPrompt(**{**values, **fields})


def test_code_samples_carry_the_model_settings_and_conversation_and_no_key():
    prompt = _prompt()
    samples = {s.name: s.code for s in code_samples(base_url="https://gpu.example/v1", prompt=prompt)}
    assert set(samples) == {"curl", "Python", "JavaScript"}
    for code in samples.values():
        assert "https://gpu.example/v1" in code and "OPENAI_API_KEY" in code and "sk-" not in code
        assert '"chat-a"' in code and "0.2" in code and "0.9" in code and "64" in code and "Hello!" in code


def test_the_curl_sample_sends_exactly_the_request_body():
    prompt = _prompt()
    curl = next(s.code for s in code_samples(base_url="https://gpu.example/v1", prompt=prompt) if s.name == "curl")
    # What the shell would pass to -d: the command split as a POSIX shell splits it.
    words = shlex.split(curl.replace("\\\n", " "))
    assert words[-2] == "-d" and json.loads(words[-1]) == prompt.request_body()


def test_the_python_sample_calls_the_sdk_with_the_request_body(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    prompt = _prompt()
    python = next(s.code for s in code_samples(base_url="https://gpu.example/v1", prompt=prompt) if s.name == "Python")
    captured = {}

    class Completions:
        def create(self, **arguments):
            captured.update(arguments)

            class Reply:
                choices = [type("Choice", (), {"message": type("Message", (), {"content": "ok"})})]

            return Reply

    class OpenAI:  # the SDK stands outside the system; the sample's own code runs as written
        def __init__(self, base_url, api_key):
            captured["base_url"], captured["api_key"] = base_url, api_key
            self.chat = type("Chat", (), {"completions": Completions()})

    code = python.replace("from openai import OpenAI\n", "")
    exec(compile(code, "sample.py", "exec"), {"OpenAI": OpenAI})
    assert (captured.pop("base_url"), captured.pop("api_key")) == ("https://gpu.example/v1", "sk-from-the-environment")
    assert captured == prompt.request_body()


def test_the_code_view_follows_the_form_and_fills_in_what_is_not_valid_yet(client):
    ModelFactory(public_name="chat-a", context_length=512)
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory()))
    response = client.get(
        reverse("dashboard:playground_code"),
        {"model": "chat-a", "temperature": "abc", "max_tokens": "7", "message": ""},
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert page.count('data-testid="code-sample"') == 3
    assert "&quot;max_tokens&quot;: 7" in page or "max_tokens=7" in page
    assert "0.7" in page and "Your next message" in page  # the initial temperature, a placeholder message


def test_the_code_view_is_for_signed_in_users(client):
    response = client.get(reverse("dashboard:playground_code"))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def _ready(model, *, worker_state=None):
    from controlplane.fleet.models import Replica, Worker
    from tests.controlplane.factories import DeploymentFactory, ReplicaFactory, WorkerFactory

    worker = WorkerFactory(state=worker_state or Worker.State.ONLINE)
    ReplicaFactory(deployment=DeploymentFactory(model=model), worker=worker, state=Replica.State.READY)


def _selected_model(client) -> str:
    page = client.get(reverse("dashboard:playground")).content.decode()
    select = page[page.index('<select name="model"') : page.index("</select>", page.index('<select name="model"'))]
    chosen = [part.split('"')[1] for part in select.split("<option")[1:] if " selected" in part.split(">")[0]]
    return chosen[0] if chosen else ""


def test_the_page_offers_the_first_ready_chat_model_with_multi_line_inputs(client):
    from controlplane.catalog.models import Model
    from controlplane.fleet.models import Worker

    ModelFactory(public_name="a-not-loaded")  # first by name and age, but nothing serves it
    _ready(ModelFactory(public_name="0-on-a-lost-worker"), worker_state=Worker.State.LOST)
    _ready(ModelFactory(public_name="b-vision", kind=Model.Kind.VISION))  # chats with images only
    _ready(ModelFactory(public_name="real-chat"))
    _ready(ModelFactory(public_name="demo-noise"))  # ready too, but added to the catalog later
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory()))

    assert _selected_model(client) == "real-chat"
    page = client.get(reverse("dashboard:playground")).content.decode()
    assert '<textarea name="message"' in page and '<textarea name="system_prompt"' in page


def test_with_no_ready_chat_model_the_page_selects_none(client):
    ModelFactory(public_name="chat-a")
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory()))
    assert _selected_model(client) == ""


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
def test_operators_and_admins_open_the_playground_which_names_the_tenant_that_pays(client, settings, role):
    settings.PLAYGROUND_STAFF_TENANT = "Platform team"
    ModelFactory(public_name="chat-a")
    client.force_login(UserFactory(role=role, tenant=None))
    page = client.get(reverse("dashboard:playground"))
    assert page.status_code == 200
    assert 'id="playground-billed-to"' in page.content.decode() and "Platform team" in page.content.decode()
    assert f'href="{reverse("dashboard:playground")}"' in page.content.decode()  # in their menu
    assert client.get(reverse("dashboard:playground_code"), {"model": "chat-a", "message": "Hi"}).status_code == 200


def test_a_members_playground_names_no_other_tenant(client):
    ModelFactory(public_name="chat-a")
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory()))
    assert 'id="playground-billed-to"' not in client.get(reverse("dashboard:playground")).content.decode()


PNG_DATA_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 300).decode()


def _vision_form(**fields) -> PlaygroundForm:
    ModelFactory(public_name="chat-a", context_length=512)
    ModelFactory(public_name="seer", context_length=512, kind="vision", max_image_bytes=1000)
    values = {"model": "seer", "message": "What is it?", "temperature": "0", "max_tokens": "16", "image": PNG_DATA_URL}
    return PlaygroundForm({**values, **fields})


def test_an_attached_image_goes_with_the_message_to_a_vision_model():
    form = _vision_form(history=json.dumps([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]))
    assert form.is_valid(), form.errors
    assert form.vision_models() == ["seer"]
    prompt = form.prompt()
    assert prompt.chat_body()["messages"][-1] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is it?"},
            {"type": "image_url", "image_url": {"url": PNG_DATA_URL}},
        ],
    }
    assert prompt.turns()[-1] == {"role": "user", "content": "What is it?", "image": True}
    # The conversation the page keeps holds the turn's text; the image went with its message.
    assert prompt.history_after("A picture.")[-2:] == [
        {"role": "user", "content": "What is it?"},
        {"role": "assistant", "content": "A picture."},
    ]
    without = PlaygroundForm({**form.data, "image": ""})
    assert without.is_valid(), without.errors
    assert without.prompt().chat_body()["messages"][-1] == {"role": "user", "content": "What is it?"}


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"model": "chat-a"}, "'chat-a' is a text-only model and cannot take images"),
        ({"image": "data:image/png;base64," + "A" * 2000}, "'seer' takes images of at most 1000 bytes"),
        ({"image": "data:text/plain;base64,aGk="}, "Attach a PNG, JPEG, WebP or GIF image file."),
        ({"image": "https://example.com/cat.png"}, "Attach a PNG, JPEG, WebP or GIF image file."),
    ],
)
def test_an_image_the_model_cannot_take_is_refused_at_the_field(fields, error):
    form = _vision_form(**fields)
    assert not form.is_valid()
    assert error in " ".join(form.errors["image"])


def test_the_page_offers_an_image_for_vision_models_only(client):
    ModelFactory(public_name="chat-a", context_length=512)
    ModelFactory(public_name="seer", context_length=512, kind="vision")
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory()))
    page = client.get(reverse("dashboard:playground")).content.decode()
    assert '<script id="playground-vision-models" type="application/json">["seer"]</script>' in page
    field = page[page.index('id="field-image"') : page.index("</div>", page.index('id="field-image"'))]
    assert " hidden>" in field.split("\n")[0]  # hidden until the page's script sees a vision model chosen
    assert 'type="file"' in field and 'name="image"' in field and 'accept="image/png,image/jpeg' in field
    # The code view leaves the image's data out of its query string.
    assert 'hx-include="#playground-form" hx-params="not image"' in page
