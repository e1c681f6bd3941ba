"""POST /v1/messages, Anthropic's Messages API, as a chat completion: `system` becomes a system
message, `tool_use` blocks an assistant's tool calls, `tool_result` blocks tool messages; the
answer's text and tool calls come back as content blocks, its finish reason as `stop_reason`, and
a stream as Anthropic's events. Errors are in Anthropic's shape. The key may come in `x-api-key`.
"""

import json
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from controlplane.billing.holds import usage_cached_tokens
from controlplane.billing.refusals import SHED_ERROR_CODE
from controlplane.gateway.dialects import ChatDeltas, Dialect, StreamTranslator, parsed, sse
from controlplane.gateway.errors import GatewayError, bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Block(BaseModel):
    # Blocks echoed back from a response carry fields this API does not use (citations, caller).
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False
    cache_control: dict | None = None


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class ToolSpec(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None
    service_tier: str | None = None


# Anthropic's error type for each status the gateway answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
    504: "api_error",
}
ANTHROPIC_OVERLOADED = 529  # Anthropic's status for "overloaded, retry later"
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicError(GatewayError):
    """A GatewayError answered in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""

    def __init__(self, error: GatewayError):
        # A shed request is Anthropic's 529 overloaded_error, which its SDKs retry after retry-after.
        status = ANTHROPIC_OVERLOADED if error.code == SHED_ERROR_CODE else error.status
        super().__init__(
            status, error.message, type=error.type, param=error.param, code=error.code, headers=error.headers
        )

    def body(self) -> bytes:
        kind = _ERROR_TYPES.get(self.status, "api_error")
        if self.type == "insufficient_quota":
            kind = "billing_error"
        return json.dumps({"type": "error", "error": {"type": kind, "message": self.message}}).encode()

    def response(self, request_id: str, extra_headers: dict[str, str] | None = None):
        return super().response(request_id, {**(extra_headers or {}), "request-id": request_id})


def text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(block.text for block in content)


def chat_messages(request: MessagesRequest) -> list[dict]:
    messages: list[dict] = []
    if request.system:
        messages.append({"role": "system", "content": text_of(request.system)})
    for index, message in enumerate(request.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        texts = [b.text for b in blocks if isinstance(b, TextBlock)]
        calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        if message.role == "user" and calls:
            raise bad_request(
                f"messages.{index}.content: tool_use blocks belong to assistant messages", param=f"messages.{index}"
            )
        if message.role == "assistant" and results:
            raise bad_request(
                f"messages.{index}.content: tool_result blocks belong to user messages", param=f"messages.{index}"
            )
        for result in results:
            messages.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": text_of(result.content)})
        if message.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.input)}}
                    for c in calls
                ]
            messages.append(turn)
        elif texts or not results:
            messages.append({"role": "user", "content": "".join(texts)})
    return messages


def chat_request(request: MessagesRequest) -> dict:
    body: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request),
        "max_tokens": request.max_tokens,
        "stream": request.stream,
    }
    for name, value in (("temperature", request.temperature), ("top_p", request.top_p), ("top_k", request.top_k)):
        if value is not None:
            body[name] = value
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice.name: name the tool to use", param="tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if body.get("tool_choice") is not None and not request.tools:
        raise bad_request("tool_choice: give tools to choose from", param="tool_choice")
    return body


def stop_reason(finish_reason: str | None, stop_string: str | None) -> str:
    if finish_reason == "stop" and stop_string:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason or "", "end_turn")


def _prompt_usage(prompt_tokens: int, cached_tokens: int) -> dict:
    """Anthropic's split of a prompt's tokens, whose three parts add up to the prompt (its clients
    sum them, and price each part): `input_tokens` are those not read from the cache. The prefix
    cache keeps every computed block on its own, at no extra price, so no tokens are reported as
    written to it: Anthropic prices `cache_creation_input_tokens` above plain input, which would
    overstate the cost of every first prompt."""
    cached = min(max(0, cached_tokens), prompt_tokens)
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt = _prompt_usage(usage.get("prompt_tokens", 0), usage_cached_tokens(usage))
    return {**prompt, "output_tokens": usage.get("completion_tokens", 0)}


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class AnthropicMessages(Dialect):
    def __init__(self):
        self.model = ""

    def authorization(self, request: Request) -> str | None:
        key = request.headers.get("x-api-key")
        return f"Bearer {key}" if key else request.headers.get("authorization")

    async def translate(self, gw, grant, raw: bytes) -> bytes:
        request = parsed(MessagesRequest, raw)
        self.model = request.model
        return json.dumps(chat_request(request)).encode()

    async def answer(self, gw, grant, chat: dict) -> dict:
        choice = (chat.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        content: list[dict] = []
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            content.append(
                {
                    "type": "tool_use",
                    "id": call.get("id"),
                    "name": function.get("name"),
                    "input": _arguments(function.get("arguments")),
                }
            )
        stop_string = choice.get("stop_reason")
        return {
            "id": _message_id(),
            "type": "message",
            "role": "assistant",
            "model": chat.get("model", self.model),
            "content": content,
            "stop_reason": stop_reason(choice.get("finish_reason"), stop_string),
            "stop_sequence": stop_string if isinstance(stop_string, str) else None,
            "usage": _usage(chat.get("usage")),
        }

    def stream(self) -> StreamTranslator:
        return MessagesStream(self.model)


class MessagesStream(StreamTranslator):
    """Anthropic's event sequence: message_start (already counting the prompt's tokens, split as
    the final usage splits them), then per
    content block content_block_start, its deltas (text_delta or input_json_delta) and
    content_block_stop, one block after another; message_delta with the stop reason and usage;
    message_stop."""

    def __init__(self, model: str):
        self.model, self.deltas = model, ChatDeltas()
        self.started = False
        self.blocks = 0  # content blocks opened so far
        self.open: tuple | None = None  # the open block: ("text",) or ("call", chat index)

    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return sse(kind, json.dumps({"type": kind, **fields}).encode())

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        message = {
            "id": _message_id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**_prompt_usage(self.prompt_tokens, self.cached_prompt_tokens), "output_tokens": 0},
        }
        return self._event("message_start", message=message)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return self._event("content_block_stop", index=self.blocks - 1)

    def _open(self, which: tuple, block: dict) -> bytes:
        out = self._close()
        self.open = which
        self.blocks += 1
        return out + self._event("content_block_start", index=self.blocks - 1, content_block=block)

    def chunk(self, event: dict) -> bytes:
        return self._start() + self._blocks(self.deltas.read(event))

    def _blocks(self, pieces: list[tuple]) -> bytes:
        out = b""
        for piece in pieces:
            if piece[0] == "text":
                if self.open != ("text",):
                    out += self._open(("text",), {"type": "text", "text": ""})
                out += self._event(
                    "content_block_delta", index=self.blocks - 1, delta={"type": "text_delta", "text": piece[1]}
                )
            elif piece[0] == "call_opened":
                call = self.deltas.calls[piece[1]]
                block = {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}}
                out += self._open(("call", piece[1]), block)
            else:
                out += self._event(
                    "content_block_delta",
                    index=self.blocks - 1,
                    delta={"type": "input_json_delta", "partial_json": piece[2]},
                )
        return out

    def finish(self, usage: dict | None) -> bytes:
        out = self._start() + self._blocks(self.deltas.rest()) + self._close()
        reason = stop_reason(self.deltas.finish_reason, self.deltas.stop_string)
        delta = {"stop_reason": reason, "stop_sequence": self.deltas.stop_string}
        out += self._event("message_delta", delta=delta, usage=_usage(usage))
        return out + self._event("message_stop")

    def failed(self, message: str, code: str) -> bytes:
        return self._event("error", error={"type": "api_error", "message": message})
