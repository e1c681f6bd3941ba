"""The playground's generation: a streamed chat completion through the gateway's own /v1 app.

The request is handed to the gateway's ASGI app in this process (the same app, and so the same
key cache, routing table, rate limits, credit holds and settlement, that serves API clients) with
a short-lived key of the tenant's: routing, limits and billing are those of an API request by
construction. No HTTP hop, no base URL to configure. Stopping is what a client disconnecting
is: the app's next `receive()` answers `http.disconnect`, and the gateway's relay closes the
replica's stream, which aborts the request on the worker and settles it by the gateway's rules
(after the first token it is charged once, as cancelled).
"""

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from django import forms
from django.core.exceptions import ValidationError

from controlplane.catalog.selectors import image_rules, models_for_playground
from controlplane.gateway.app import process_app
from gpuworker.contract.openai_api import ProtocolError, data_url_bytes

_PATH = "/v1/chat/completions"
MAX_TOKENS_LIMIT = 4096
# Calls still finishing after their session went away (settling takes a moment); kept referenced.
_finishing: set[asyncio.Task] = set()


MAX_HISTORY_MESSAGES = 100
# What "view code" puts where the message box is still empty.
MESSAGE_PLACEHOLDER = "Your next message"
HISTORY_ROLES = ("user", "assistant")
# The page attaches an image as a data: URL read from a file (the gateway's formats).
IMAGE_DATA_URL = re.compile(r"^data:image/(png|jpeg|webp|gif);base64,[A-Za-z0-9+/=]*$")
# Base64 of the catalog's largest image limit (20 MiB) and its prefix; each model's own limit applies.
MAX_IMAGE_DATA_URL_CHARS = 4 * (20 << 20) // 3 + 64
SEND_ON_CTRL_ENTER = (
    "if (event.key === 'Enter' && (event.ctrlKey || event.metaKey)) "
    "{ event.preventDefault(); this.form.requestSubmit(); }"
)


@dataclass(frozen=True)
class PlaygroundPrompt:
    model: str
    system_prompt: str
    message: str
    temperature: float
    top_p: float
    max_tokens: int
    # The conversation so far, oldest first: {"role": "user" | "assistant", "content": ...} each.
    history: tuple[dict, ...] = ()
    # An image attached to this message, as a data: URL ("": none). It goes with this message only:
    # the conversation kept in the page holds the turns' text.
    image: str = ""

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        content: str | list[dict] = self.message
        if self.image:
            content = [{"type": "text", "text": self.message}, {"type": "image_url", "image_url": {"url": self.image}}]
        return [*system, *self.history, {"role": "user", "content": content}]

    def request_body(self) -> dict:
        """The chat completion as an API client sends it (what "view code" shows)."""
        return {
            "model": self.model,
            "messages": self.messages(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
        }

    def chat_body(self) -> dict:
        return {**self.request_body(), "stream": True, "stream_options": {"include_usage": True}}

    def turns(self) -> list[dict]:
        """The conversation as the page shows it while the answer streams: no system prompt."""
        return [*self.history, {"role": "user", "content": self.message, "image": bool(self.image)}]

    def history_after(self, answer: str) -> list[dict]:
        """The conversation once `answer` (possibly cut short by Stop) follows this message."""
        return [*self.history, {"role": "user", "content": self.message}, {"role": "assistant", "content": answer}]


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str | None
    usage: dict | None  # the gateway's usage, with the request's `cost`


@dataclass(frozen=True)
class Stopped:
    """The stream ended because the caller stopped it."""


@dataclass(frozen=True)
class Failed:
    message: str
    code: str | None
    status: int


Event = Delta | Finished | Stopped | Failed


class DeltaBatcher:
    """Sends an answer's text as it streams, at most one send per `interval` seconds, joining the
    deltas that arrived meanwhile. One fragment per token costs a template render, a WebSocket
    frame and an htmx swap in the page each, which made the playground far slower than the API
    for the same answer (bench/playground.py measures both); joined, the page keeps up with the
    stream and the text still appears as it comes (the first delta goes at once)."""

    def __init__(self, send: Callable[[str], Awaitable[None]], *, interval: float) -> None:
        self._send, self._interval = send, interval
        self._pending: list[str] = []
        self._sending: asyncio.Task | None = None
        self._last_sent = float("-inf")
        self._sleeping = self._flushing = False

    def add(self, text: str) -> None:
        self._pending.append(text)
        if self._sending is None or self._sending.done():
            self._sending = asyncio.ensure_future(self._send_pending())

    async def _send_pending(self) -> None:
        loop = asyncio.get_running_loop()
        # Runs until nothing is pending: text added while a send is under way goes in the next one.
        while self._pending:
            delay = self._last_sent + self._interval - loop.time()
            if delay > 0 and not self._flushing:
                self._sleeping = True
                try:
                    await asyncio.sleep(delay)
                finally:
                    self._sleeping = False
            text = "".join(self._pending)
            self._pending.clear()
            self._last_sent = loop.time()
            await self._send(text)

    async def flush(self) -> None:
        """Send what is pending now, after any send under way: the answer's end comes after its text."""
        self._flushing = True
        sending = self._sending
        if sending is not None and not sending.done():
            if self._sleeping:  # only a wait is cut short, never a send (frames keep their order)
                sending.cancel()
            try:
                await sending
            except asyncio.CancelledError:
                pass
        await self._send_pending()


class PlaygroundForm(forms.Form):
    """What the page's Send form carries (as JSON over the WebSocket); field errors go back to
    the fields."""

    model = forms.ChoiceField()
    system_prompt = forms.CharField(
        required=False, max_length=8000, strip=False, widget=forms.Textarea(attrs={"rows": 2})
    )
    message = forms.CharField(
        max_length=32000,
        strip=False,
        # Enter starts a new line; Ctrl+Enter (Cmd+Enter) sends, as the Send button does.
        widget=forms.Textarea(attrs={"rows": 4, "onkeydown": SEND_ON_CTRL_ENTER}),
        help_text="Ctrl+Enter sends.",
    )
    temperature = forms.FloatField(min_value=0.0, max_value=2.0, initial=0.7)
    top_p = forms.FloatField(
        min_value=0.0,
        max_value=1.0,
        initial=1.0,
        required=False,
        label="Top p",
        help_text="Sample from the smallest set of tokens whose probabilities add up to this.",
    )
    max_tokens = forms.IntegerField(min_value=1, max_value=MAX_TOKENS_LIMIT, initial=128)
    # The conversation so far as JSON, kept in the page (the server keeps no conversation): each
    # answer's fragment writes it back with the new turn.
    history = forms.JSONField(required=False, widget=forms.HiddenInput)
    # An image for a vision model: the page reads the chosen file into this field as a data: URL.
    image = forms.CharField(required=False, max_length=MAX_IMAGE_DATA_URL_CHARS, widget=forms.HiddenInput)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        models = list(models_for_playground())
        self.context_lengths = {m.public_name: m.served_context_length for m in models}
        self.image_rules = {
            m.public_name: image_rules(
                public_name=m.public_name,
                kind=m.kind,
                max_images_per_request=m.max_images_per_request,
                max_image_bytes=m.max_image_bytes,
            )
            for m in models
        }
        self.fields["model"].choices = [(name, name) for name in self.context_lengths]

    def vision_models(self) -> list[str]:
        """The models the page offers an image for."""
        return [name for name, rules in self.image_rules.items() if rules.takes_images]

    def clean_message(self) -> str:
        message = self.cleaned_data["message"]
        if not message.strip():
            raise ValidationError("Write a message to send.")
        return message

    def clean_top_p(self) -> float:
        top_p = self.cleaned_data["top_p"]
        return self.fields["top_p"].initial if top_p is None else top_p  # empty: the API's default

    def clean_history(self) -> tuple[dict, ...]:
        history = self.cleaned_data["history"] or []
        if not isinstance(history, list) or len(history) > MAX_HISTORY_MESSAGES:
            raise ValidationError(
                f"The conversation must be a list of at most {MAX_HISTORY_MESSAGES} messages; start a new conversation."
            )
        for message in history:
            if (
                not isinstance(message, dict)
                or set(message) != {"role", "content"}
                or message["role"] not in HISTORY_ROLES
                or not isinstance(message["content"], str)
            ):
                raise ValidationError(
                    "The conversation holds a message that is not a user or assistant "
                    "message with text content; start a new conversation."
                )
        return tuple(history)

    def clean_image(self) -> str:
        image = self.cleaned_data["image"]
        if image and not IMAGE_DATA_URL.match(image):
            raise ValidationError("Attach a PNG, JPEG, WebP or GIF image file.")
        return image

    def clean(self):
        data = super().clean()
        model, max_tokens = data.get("model"), data.get("max_tokens")
        if model and data.get("image"):
            try:  # the gateway's rule for the model's images, shown at the field
                self.image_rules[model].check(["image"], [data_url_bytes(data["image"])])
            except ProtocolError as refused:
                self.add_error("image", refused.message.partition(": ")[2] or refused.message)
        if model and max_tokens and max_tokens >= self.context_lengths[model]:
            self.add_error(
                "max_tokens",
                f"At most {self.context_lengths[model] - 1} for {model} "
                f"(its context is {self.context_lengths[model]} tokens).",
            )
        return data

    def prompt_so_far(self) -> PlaygroundPrompt:
        """The prompt with what is valid of the fields so far and each other field's initial value
        (a placeholder message): what "view code" shows while the form is being filled in."""
        self.is_valid()
        data = {name: self.cleaned_data.get(name) for name in self.fields if name not in self.errors}

        def value(name, default=None):
            if data.get(name) not in (None, ""):
                return data[name]
            return self.fields[name].initial if default is None else default

        return PlaygroundPrompt(
            model=value("model", next(iter(self.context_lengths), "")),
            system_prompt=value("system_prompt", ""),
            message=value("message", MESSAGE_PLACEHOLDER),
            temperature=value("temperature"),
            top_p=value("top_p"),
            max_tokens=value("max_tokens"),
            history=value("history", ()),
        )

    def prompt(self) -> PlaygroundPrompt:
        data = self.cleaned_data
        return PlaygroundPrompt(
            model=data["model"],
            system_prompt=data["system_prompt"],
            message=data["message"],
            temperature=data["temperature"],
            top_p=data["top_p"],
            max_tokens=data["max_tokens"],
            history=data["history"],
            image=data["image"],
        )


def empty_message_input() -> str:
    """The message box, emptied, for the page to swap in once the answer joined the conversation."""
    field = PlaygroundForm.base_fields["message"]
    attrs = {**field.widget_attrs(field.widget), "id": "id_message", "required": True, "hx-swap-oob": "true"}
    return field.widget.render("message", "", attrs=attrs)


async def stream_chat(
    *, api_key: str, prompt: PlaygroundPrompt, stop: asyncio.Event, app: Callable | None = None
) -> AsyncIterator[Event]:
    """The answer to `prompt` as events: deltas, then Finished, Stopped or Failed (exactly one)."""
    body = json.dumps(prompt.chat_body()).encode()
    headers = [
        (b"authorization", f"Bearer {api_key}".encode()),
        (b"content-type", b"application/json"),
        (b"host", b"playground.internal"),
        (b"content-length", str(len(body)).encode()),
    ]
    status, error_body, buffer = 0, b"", b""
    finish_reason, usage = None, None
    async for message in _asgi_post(app or process_app(), _PATH, body, headers, stop):
        if message["type"] == "http.response.start":
            status = message["status"]
            continue
        if message["type"] != "http.response.body":
            continue
        if status != 200:
            error_body += message.get("body", b"")
            continue
        buffer += message.get("body", b"")
        *events, buffer = buffer.split(b"\n\n")
        for raw in events:
            if not raw.startswith(b"data: "):
                continue
            data = raw[len(b"data: ") :]
            if data == b"[DONE]":
                yield Finished(finish_reason, usage)
                return
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                yield Failed(error.get("message", "The generation failed."), error.get("code"), 502)
                return
            if event.get("usage") and not event.get("choices"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                if text := (choice.get("delta") or {}).get("content"):
                    yield Delta(text)
                if choice.get("finish_reason") is not None:
                    finish_reason = choice["finish_reason"]
    if status and status != 200:
        yield _failure(status, error_body)
    elif stop.is_set():
        yield Stopped()
    else:
        yield Failed("The stream ended before the answer was complete.", "incomplete", 502)


def _failure(status: int, body: bytes) -> Failed:
    try:
        error = json.loads(body)["error"]
        return Failed(error.get("message") or "The request failed.", error.get("code"), status)
    except (ValueError, KeyError, TypeError):
        return Failed(f"The request failed ({status}).", None, status)


async def _asgi_post(app: Callable, path: str, body: bytes, headers: list, stop: asyncio.Event) -> AsyncIterator[dict]:
    """POST `body` to the ASGI `app` and yield what it sends; `stop` set means the client went away."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("playground.internal", 80),
    }
    sent: asyncio.Queue = asyncio.Queue()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await stop.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.put_nowait(message)

    call = asyncio.ensure_future(app(scope, receive, send))
    call.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            yield message
        call.result()  # an exception in the app is a bug: let it show
    finally:
        if not call.done():
            # Our reader left early: to the app that is a client going away. It finishes (and
            # settles) on its own; keep it referenced until then.
            stop.set()
            _finishing.add(call)
            call.add_done_callback(_finishing.discard)
