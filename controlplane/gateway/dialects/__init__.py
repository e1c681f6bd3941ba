"""API dialects other than OpenAI's chat completions: each translates its request into the chat
completion request the gateway serves, and the chat answer (whole or streamed) back into its own
shape. Admission, credit holds, routing, the relay and settlement stay the chat path's
(completions.serve), written once.
"""

import json

from starlette.requests import Request

from controlplane.gateway.errors import bad_request
from gpuworker.contract.openai_api import ProtocolError, parse_json_body, parse_request


class StreamTranslator:
    """One streamed answer in a dialect's events: the relay hands it the replica's chat chunks
    (the first with the first token, so the events that open the stream go out with it)."""

    # The prompt's length in tokens, and how many of them its prefix cache served, as the replica
    # told them before its first chunk (0 if it did not): the relay sets them, for the events that
    # open the stream.
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0

    def chunk(self, event: dict) -> bytes:
        """The events for one chat completion chunk (possibly none)."""
        raise NotImplementedError

    def finish(self, usage: dict | None) -> bytes:
        """The events that close a complete stream; `usage` carries the request's cost."""
        raise NotImplementedError

    def failed(self, message: str, code: str) -> bytes:
        """The event that ends a stream the replica broke off."""
        raise NotImplementedError

    async def completed(self) -> None:
        """After `finish`, before its events go out (e.g. storing the answer); must not raise."""


class Dialect:
    """One request in a dialect: built by its route, used by completions.serve."""

    def authorization(self, request: Request) -> str | None:
        return request.headers.get("authorization")

    async def translate(self, gw, grant, raw: bytes) -> bytes:
        """The chat completion request body for the dialect's body `raw`; GatewayError (400) for
        a body the dialect refuses."""
        raise NotImplementedError

    async def answer(self, gw, grant, chat: dict) -> dict:
        """The dialect's whole answer for the replica's chat completion `chat` (usage priced)."""
        raise NotImplementedError

    def stream(self) -> StreamTranslator:
        raise NotImplementedError


def sse(event: str | None, data: bytes) -> bytes:
    """One server-sent event, named `event` (None: unnamed)."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


def parsed(schema, raw: bytes):
    """`raw` validated by the pydantic `schema`; a 400 naming the first bad field otherwise."""
    try:
        return parse_request(schema, parse_json_body(raw))
    except ProtocolError as exc:
        raise bad_request(exc.message, param=exc.param, code=exc.code) from None


class ChatDeltas:
    """A chat completion stream's first choice read as what a dialect builds its events from:
    text, and tool calls (opened with their id and name, then argument fragments), one block at a
    time. A dialect's blocks (Anthropic's content blocks, the Responses API's output items) do not
    interleave, while a model's tool calls may (an earlier call's last fragments after a later call
    opened): the block being streamed goes on, and what comes for the blocks after it is held, in
    order, until it is done (a tool call once its arguments are a whole JSON object, text once
    anything else comes). `rest` gives what is still held when the stream ends."""

    def __init__(self):
        self.text_parts: list[str] = []
        self.calls: dict[int, dict] = {}  # the choice's tool calls by their index: id, name, arguments
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.current: tuple | None = None  # the block being streamed: ("text",) or ("call", index)
        self.held: list[tuple[tuple, list[tuple]]] = []  # the blocks after it: each one's key and pieces

    def read(self, event: dict) -> list[tuple]:
        """("text", fragment), ("call", index, fragment) or ("call_opened", index) per piece, in
        the order of the blocks they belong to."""
        pieces: list[tuple] = []
        for piece in self._pieces(event):
            pieces += self._in_order(piece)
        return pieces

    def rest(self) -> list[tuple]:
        """The pieces still held at the stream's end, block after block."""
        pieces = [piece for _, held in self.held for piece in held]
        self.held = []
        return pieces

    def _pieces(self, event: dict) -> list[tuple]:
        pieces: list[tuple] = []
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.text_parts.append(delta["content"])
                pieces.append(("text", delta["content"]))
            for call in delta.get("tool_calls") or ():
                index, function = call.get("index", 0), call.get("function") or {}
                if index not in self.calls:
                    self.calls[index] = {
                        "id": call.get("id") or "",
                        "name": function.get("name") or "",
                        "arguments": "",
                    }
                    pieces.append(("call_opened", index))
                if function.get("arguments"):
                    self.calls[index]["arguments"] += function["arguments"]
                    pieces.append(("call", index, function["arguments"]))
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_string = choice.get("stop_reason")
        return pieces

    def _in_order(self, piece: tuple) -> list[tuple]:
        key = ("text",) if piece[0] == "text" else ("call", piece[1])
        out: list[tuple] = []
        if key == self.current:
            out.append(piece)
        elif piece[0] == "call":
            lane = next((held for held_key, held in self.held if held_key == key), None)
            if lane is None:
                return []  # past its whole JSON arguments, after its block closed: nothing they could add
            lane.append(piece)
        elif piece[0] == "text" and self.held and self.held[-1][0] == key:
            self.held[-1][1].append(piece)
        else:
            self.held.append((key, [piece]))  # a block that opens after those held
        while self.held and (self.current is None or self._done(self.current)):
            self.current, pieces = self.held.pop(0)
            out += pieces
        return out

    def _done(self, key: tuple) -> bool:
        if key[0] == "text":
            return True
        try:
            return isinstance(json.loads(self.calls[key[1]]["arguments"]), dict)
        except ValueError:
            return False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)
