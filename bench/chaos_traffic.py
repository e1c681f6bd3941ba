"""The chaos suite's clients: tenants sending a seeded mix of chat and completion requests,
streaming or not, with a JSON schema or tools, some of them leaving at random points; and what
each client saw, judged as an OpenAI client would (a whole answer, a stream ending in [DONE], or
an OpenAI-shaped error), with the request id the gateway gave it.

Pure of Django: `bench/chaos.py` runs it, `chaos_audit` compares it with the ledger.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

# What a client does with its request: wait for all of it, or leave at one of three points.
STAY, LEAVE_EARLY, LEAVE_MID_STREAM, LEAVE_WAITING = "stay", "leave_early", "leave_mid_stream", "leave_waiting"
# How a request ended, seen from the client.
COMPLETED, ERROR, STREAM_ERROR, LEFT, BROKEN = "completed", "error", "stream_error", "left", "broken"

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}},
    "required": ["answer"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
KINDS = ("chat", "chat_stream", "completion", "completion_stream", "json_schema", "tools")


@dataclass
class ClientRecord:
    """One request as its client saw it."""

    tenant: str
    kind: str
    plan: str
    started: float  # time.monotonic()
    ended: float = 0.0
    request_id: str | None = None  # from x-request-id; None if the client left before the headers
    status: int | None = None
    outcome: str = ""
    code: str = ""  # the error's code (or type), or the transport failure's class
    well_formed: bool | None = None  # None: the client left, there was nothing whole to judge
    first_token: bool = False

    @property
    def label(self) -> str:
        if self.outcome in (COMPLETED, LEFT):
            return self.outcome
        return f"{self.outcome} {self.status or ''} {self.code}".replace("  ", " ").strip()

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Tenant:
    name: str
    api_key: str


def request_body(kind: str, model: str, rng: random.Random) -> tuple[str, dict]:
    """The path and body of one request of `kind`, a few tokens long (CPU replicas are slow)."""
    words = " ".join(rng.choice(("tell", "me", "about", "the", "sea", "sky", "a", "cat", "why")) for _ in range(6))
    body: dict = {"model": model, "max_tokens": rng.randint(4, 24), "temperature": 1.0, "seed": rng.randint(0, 9999)}
    if kind.startswith("completion"):
        path, body["prompt"] = "/v1/completions", words
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
    if kind.endswith("_stream"):
        body["stream"] = True
        body["ignore_eos"] = True  # long enough to be left mid-stream
    if kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    if kind == "tools":
        body["tools"], body["tool_choice"] = TOOLS, "auto"
    return path, body


def choose_plan(kind: str, rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.75:
        return STAY
    if roll < 0.85:
        return LEAVE_EARLY
    return LEAVE_MID_STREAM if kind.endswith("_stream") else LEAVE_WAITING


def is_error_body(data) -> bool:
    """An OpenAI error: {"error": {"message", "type", "param", "code"}} with a message."""
    error = data.get("error") if isinstance(data, dict) else None
    return (
        isinstance(error, dict)
        and {"message", "type", "param", "code"} <= error.keys()
        and isinstance(error["message"], str)
        and bool(error["message"])
    )


def is_answer(data, path: str) -> bool:
    expected = "chat.completion" if path.endswith("chat/completions") else "text_completion"
    return (
        isinstance(data, dict)
        and data.get("object") == expected
        and isinstance(data.get("choices"), list)
        and bool(data["choices"])
        and isinstance(data.get("usage"), dict)
        and isinstance(data.get("id"), str)
    )


def is_chunk(data, path: str) -> bool:
    expected = "chat.completion.chunk" if path.endswith("chat/completions") else "text_completion"
    return isinstance(data, dict) and data.get("object") == expected and isinstance(data.get("choices"), list)


def judge_whole(record: ClientRecord, status: int, content: bytes, path: str) -> None:
    """A non-streaming answer, or any error answered before a stream began."""
    record.status = status
    try:
        data = json.loads(content)
    except ValueError:
        record.outcome, record.well_formed, record.code = BROKEN, False, "not JSON"
        return
    if status == 200:
        record.outcome, record.well_formed = COMPLETED, is_answer(data, path)
        record.first_token = True
        if not record.well_formed:
            record.outcome, record.code = BROKEN, "not an answer"
    else:
        record.outcome, record.well_formed = ERROR, is_error_body(data)
        record.code = (data["error"].get("code") or data["error"]["type"]) if record.well_formed else "not an error"
        if not record.well_formed:
            record.outcome = BROKEN


class StreamJudge:
    """Follows a stream's events: well formed if every event is a chunk and it ends with [DONE],
    or if its last event is an OpenAI error."""

    def __init__(self, record: ClientRecord, path: str):
        self.record, self.path, self.ended = record, path, False

    def event(self, line: str) -> None:
        if not line.startswith("data: ") or self.ended:
            if line.strip() and not line.startswith(":"):
                self._broken(f"unexpected line {line[:40]!r}")
            return
        data = line[len("data: ") :]
        if data == "[DONE]":
            self.ended = True
            self.record.outcome, self.record.well_formed = COMPLETED, True
            return
        try:
            event = json.loads(data)
        except ValueError:
            return self._broken("an event is not JSON")
        if is_error_body(event):
            self.ended = True
            self.record.outcome, self.record.well_formed = STREAM_ERROR, True
            self.record.code = event["error"].get("code") or event["error"]["type"]
        elif is_chunk(event, self.path):
            self.record.first_token = True
        else:
            self._broken("an event is neither a chunk nor an error")

    def finish(self) -> None:
        if not self.ended and self.record.outcome != BROKEN:
            self._broken("the stream ended without [DONE] or an error")

    def _broken(self, why: str) -> None:
        self.ended = True
        self.record.outcome, self.record.well_formed, self.record.code = BROKEN, False, why


async def send(
    client: httpx.AsyncClient, tenant: Tenant, kind: str, plan: str, model: str, rng: random.Random
) -> ClientRecord:
    """One request, as `plan` says; never raises for what the server or the network did."""
    path, body = request_body(kind, model, rng)
    record = ClientRecord(tenant=tenant.name, kind=kind, plan=plan, started=time.monotonic())
    headers = {"Authorization": f"Bearer {tenant.api_key}"}
    leave_after = {LEAVE_EARLY: rng.uniform(0.01, 0.4), LEAVE_WAITING: rng.uniform(0.1, 1.5)}.get(plan)
    leave_after_events = rng.randint(1, 3) if plan == LEAVE_MID_STREAM else None
    try:
        async with asyncio.timeout(leave_after):
            async with client.stream("POST", path, json=body, headers=headers) as response:
                record.request_id = response.headers.get("x-request-id")
                streaming = body.get("stream") and response.status_code == 200
                if not streaming:
                    judge_whole(record, response.status_code, await response.aread(), path)
                else:
                    record.status = 200
                    judge = StreamJudge(record, path)
                    events = 0
                    async for line in response.aiter_lines():
                        judge.event(line)
                        events += line.startswith("data: ")
                        if leave_after_events is not None and events >= leave_after_events and not judge.ended:
                            raise _Leave
                    judge.finish()
    except (TimeoutError, _Leave):
        # The context managers closed the connection: the gateway sees the client gone.
        record.outcome, record.well_formed, record.code = LEFT, None, ""
    except httpx.HTTPError as exc:
        record.outcome, record.well_formed, record.code = BROKEN, False, type(exc).__name__
    record.ended = time.monotonic()
    return record


class _Leave(Exception):
    """The client decided to go mid-stream."""


@dataclass
class Traffic:
    """`concurrency` clients sending requests for `seconds`, each with its own seeded choices."""

    base_url: str
    model: str
    tenants: list[Tenant]
    concurrency: int
    seed: int
    records: list[ClientRecord] = field(default_factory=list)

    async def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=90, limits=limits) as client:
            await asyncio.gather(*(self._client(client, i, until) for i in range(self.concurrency)))

    async def _client(self, client: httpx.AsyncClient, index: int, until: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while time.monotonic() < until:
            tenant, kind = rng.choice(self.tenants), rng.choice(KINDS)
            record = await send(client, tenant, kind, choose_plan(kind, rng), self.model, rng)
            self.records.append(record)
            if record.outcome not in (COMPLETED, LEFT):
                # As the OpenAI SDK does, a client backs off before trying again, rather than
                # counting how often a gateway can say 503 in a second.
                await asyncio.sleep(rng.uniform(0.2, 1.0))
