"""POST /v1/responses, OpenAI's Responses API, as a chat completion: `instructions` and the input
items (messages, function calls and their outputs), after the stored conversation that
`previous_response_id` names, become chat messages; function tools, `tool_choice` and
`text.format` map onto the chat request's. The answer comes back as output items (a message, then
function calls), streamed as the Responses API's events; with `store` (the default) it is kept for
GET, DELETE, input_items and the next turn (stored_responses).
"""

import json
import logging
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from controlplane.gateway.dialects import ChatDeltas, Dialect, StreamTranslator, parsed, sse
from controlplane.gateway.errors import GatewayError, bad_request
from controlplane.gateway.stored_responses import stored_response_finish, stored_response_get, stored_response_save

logger = logging.getLogger(__name__)

MAX_METADATA_KEYS = 16


class ResponsesRequest(BaseModel):
    # Fields clients send that change nothing here (include, reasoning, truncation, ...) are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: Union[str, list[dict]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    tools: list[dict] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    stream: bool = False
    user: str | None = None
    seed: int | None = None  # as in chat completions (an extension of the Responses API)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    """The text of an item's content: a string, or a list of input_text/output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: give a string or a list of content parts", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise bad_request(
                f"{where}.{index}: content parts of type {kind!r} are not supported here (input_text, output_text)",
                param=f"{where}.{index}",
            )
    return "".join(texts)


def input_items(value: str | list[dict]) -> list[dict]:
    """The request's input as items, each checked and given an id (as input_items lists them)."""
    if isinstance(value, str):
        return [{"type": "message", "id": _id("msg"), "role": "user", "content": [_part("input_text", value)]}]
    items = []
    for index, item in enumerate(value):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role: one of user, system, developer, assistant", param=f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content")
            part = _part("output_text" if role == "assistant" else "input_text", text)
            items.append({"type": "message", "id": _item_id(item, "msg"), "role": role, "content": [part]})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise bad_request(f"{where}.{name}: a string is required", param=f"{where}.{name}")
            items.append(
                {
                    "type": "function_call",
                    "id": _item_id(item, "fc"),
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                    "status": "completed",
                }
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id: a string is required", param=f"{where}.call_id")
            output = _text_of(item.get("output"), f"{where}.output")
            items.append(
                {
                    "type": "function_call_output",
                    "id": _item_id(item, "fco"),
                    "call_id": item["call_id"],
                    "output": output,
                    "status": "completed",
                }
            )
        elif kind == "reasoning":
            continue  # this model's reasoning is not replayed
        else:
            raise bad_request(
                f"{where}.type: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output)",
                param=f"{where}.type",
            )
    return items


def _item_id(item: dict, prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and 0 < len(given) <= 64 else _id(prefix)


def _part(kind: str, text: str) -> dict:
    return {"type": kind, "text": text, **({"annotations": []} if kind == "output_text" else {})}


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Items as chat messages: consecutive function calls join the assistant turn before them."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"]}}
            call["function"]["arguments"] = item["arguments"]
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise bad_request(
                f"tools.{index}: only function tools (with a name) are supported here", param=f"tools.{index}"
            )
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice: none, auto, required or {type: function, name}", param="tool_choice")


def chat_response_format(text: dict | None) -> dict | None:
    form = (text or {}).get("format")
    if form is not None and not isinstance(form, dict):
        raise bad_request("text.format: an object with a type", param="text.format")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema" and isinstance(form.get("schema"), dict):
        spec = {"name": form.get("name") or "response", "schema": form["schema"]}
        for name in ("description", "strict"):
            if form.get(name) is not None:
                spec[name] = form[name]
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request("text.format: type text, json_object, or json_schema with a schema", param="text.format")


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    out = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
    if "cost" in usage:
        out["cost"] = usage["cost"]
    return out


class Responses(Dialect):
    def __init__(self):
        self.id, self.created_at = _id("resp"), int(time.time())
        self.request: ResponsesRequest | None = None
        self.items: list[dict] = []  # this request's input items
        self.history: list[dict] = []  # the stored conversation it continues
        self.tenant_id, self.gw = 0, None
        self.translated: bytes | None = None
        self.owner = ""  # a background response: the gateway process whose claim it runs under

    async def translate(self, gw, grant, raw: bytes) -> bytes:
        if self.translated is not None:  # a background response, checked before it was queued
            return self.translated
        self.gw = gw
        request = self.request = parsed(ResponsesRequest, raw)
        if request.background and (request.stream or not request.store):
            raise bad_request(
                "background: a background response is stored and polled: not with stream, nor with store false",
                param="background",
            )
        self.tenant_id, self.items = grant.tenant_id, input_items(request.input)
        if request.previous_response_id:
            previous = await gw.admit_lane.run(
                stored_response_get, tenant_id=grant.tenant_id, response_id=request.previous_response_id
            )
            if previous is None:
                raise GatewayError(
                    404,
                    f"Previous response with id {request.previous_response_id!r} not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            self.history = previous.history
        messages = chat_messages(request.instructions, self.history + self.items)
        if not messages:
            raise bad_request("input: give the input to respond to", param="input")
        body: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
        optional = {
            "max_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": chat_tools(request.tools),
            "tool_choice": chat_tool_choice(request.tool_choice),
            "parallel_tool_calls": request.parallel_tool_calls,
            "response_format": chat_response_format(request.text),
            "user": request.user,
            "seed": request.seed,
        }
        body.update({name: value for name, value in optional.items() if value is not None})
        self.translated = json.dumps(body).encode()
        return self.translated

    def response(self, status: str, output: list[dict], usage: dict | None, finish_reason: str | None = None) -> dict:
        request = self.request
        incomplete = finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "background": request.background,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": request.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
            "user": request.user,
        }

    async def keep(self, gw, answer: dict) -> None:
        """Store the answered response (with `store`), for GET and the next turn."""
        if not self.request.store:
            return
        history = self.history + self.items + answer["output"]
        if self.request.background:  # its row was stored when it was queued
            await gw.admit_lane.run(
                stored_response_finish,
                tenant_id=self.tenant_id,
                response_id=self.id,
                history=history,
                response=answer,
                owner=self.owner,
            )
            return
        await gw.admit_lane.run(
            stored_response_save,
            tenant_id=self.tenant_id,
            response_id=self.id,
            input_items=self.items,
            history=history,
            response=answer,
        )

    async def answer(self, gw, grant, chat: dict) -> dict:
        choice = (chat.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        output = []
        if message.get("content") or not message.get("tool_calls"):
            output.append(_message_item(_id("msg"), message.get("content") or "", "completed"))
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            output.append(
                _call_item(_id("fc"), call.get("id"), function.get("name"), function.get("arguments"), "completed")
            )
        answer = self.response("completed", output, chat.get("usage"), choice.get("finish_reason"))
        try:
            await self.keep(gw, answer)
        except Exception:  # the answer is served and billed: delivered regardless, not kept for later
            logger.warning("could not store response %s", self.id, exc_info=True)
        return answer

    def stream(self) -> StreamTranslator:
        return ResponsesStream(self)


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_part("output_text", text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id, name, arguments, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments or "",
        "status": status,
    }


class ResponsesStream(StreamTranslator):
    """The Responses API's events, each with its sequence_number: response.created and
    response.in_progress; per output item output_item.added, its deltas and its .done events,
    output_item.done; then response.completed (or response.incomplete)."""

    def __init__(self, dialect: Responses):
        self.dialect, self.deltas = dialect, ChatDeltas()
        self.sequence = 0
        self.started = False
        self.output: list[dict] = []  # items done
        self.open: dict | None = None  # the item being streamed: its kind, id, and chat call index
        self.answer: dict | None = None

    def _event(self, kind: str, **fields) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields}).encode()
        self.sequence += 1
        return sse(kind, data)

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        snapshot = self.dialect.response("in_progress", [], None)
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def _close(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        index = len(self.output)
        if item["kind"] == "text":
            text = "".join(item["text"])
            part = _part("output_text", text)
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out = self._event("response.output_text.done", **common, text=text, logprobs=[])
            out += self._event("response.content_part.done", **common, part=part)
            done = _message_item(item["id"], text, "completed")
        else:
            call = self.deltas.calls[item["call"]]
            out = self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=call["name"],
                arguments=call["arguments"],
            )
            done = _call_item(item["id"], call["id"], call["name"], call["arguments"], "completed")
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=index, item=done)

    def _open_text(self) -> bytes:
        out = self._close()
        self.open = {"kind": "text", "id": _id("msg"), "text": []}
        index, item_id = len(self.output), self.open["id"]
        out += self._event(
            "response.output_item.added", output_index=index, item=_message_item(item_id, None, "in_progress")
        )
        return out + self._event(
            "response.content_part.added",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=_part("output_text", ""),
        )

    def _open_call(self, chat_index: int) -> bytes:
        out = self._close()
        call = self.deltas.calls[chat_index]
        self.open = {"kind": "call", "id": _id("fc"), "call": chat_index}
        item = _call_item(self.open["id"], call["id"], call["name"], "", "in_progress")
        return out + self._event("response.output_item.added", output_index=len(self.output), item=item)

    def chunk(self, event: dict) -> bytes:
        return self._start() + self._items(self.deltas.read(event))

    def _items(self, pieces: list[tuple]) -> bytes:
        out = b""
        for piece in pieces:
            if piece[0] == "text":
                if self.open is None or self.open["kind"] != "text":
                    out += self._open_text()
                self.open["text"].append(piece[1])
                out += self._event(
                    "response.output_text.delta",
                    item_id=self.open["id"],
                    output_index=len(self.output),
                    content_index=0,
                    delta=piece[1],
                    logprobs=[],
                )
            elif piece[0] == "call_opened":
                out += self._open_call(piece[1])
            else:
                out += self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=len(self.output),
                    delta=piece[2],
                )
        return out

    def finish(self, usage: dict | None) -> bytes:
        out = self._start() + self._items(self.deltas.rest())
        if not self.output and self.open is None:  # an empty answer is still one message
            out += self._open_text()
        out += self._close()
        self.answer = self.dialect.response("completed", self.output, usage, self.deltas.finish_reason)
        kind = "response.incomplete" if self.answer["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=self.answer)

    def failed(self, message: str, code: str) -> bytes:
        out = self._event("error", code=code, message=message, param=None)
        failed = self.dialect.response("failed", self.output, None)
        failed["error"] = {"code": "server_error", "message": message}
        return out + self._event("response.failed", response=failed)

    async def completed(self) -> None:
        try:
            await self.dialect.keep(self.dialect.gw, self.answer)
        except Exception:  # the answer went out and is billed; only its copy for later is lost
            logger.warning("could not store response %s", self.dialect.id, exc_info=True)
