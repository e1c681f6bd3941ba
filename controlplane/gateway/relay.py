"""Relaying a replica's SSE stream to the client, and reading its events.

The relay sends nothing until the replica produced its first token (the caller waits for it), so
a replica failing before that can be retried on another without the client noticing. Afterwards
chunks pass through as they are; the usage chunk (always asked of the replica) is held back,
priced and sent only if the client asked for it. A client that goes away cancels the relay and
the upstream connection is closed, which aborts the request there: charged as cancelled once its
first token went out, released unbilled before that (as while the gateway waits for that token,
see completions).
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from controlplane.gateway import metrics
from controlplane.gateway.dialects import StreamTranslator
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.holds import CANCELLED, COMPLETED, FAILED, Flight
from controlplane.gateway.upstream import UpstreamError

logger = logging.getLogger(__name__)

DONE = b"[DONE]"


class ReplicaFailed(Exception):
    """The replica failed this request before its first token: another may be tried."""


def is_first_token(data: bytes, chat: bool) -> bool:
    """Whether this event carries a token (or ends the request); raises ReplicaFailed for an error."""
    if data == DONE:
        return True
    event = json.loads(data)
    if "error" in event:
        raise ReplicaFailed(str(event["error"].get("message", event["error"])))
    if event.get("usage"):
        return True
    for choice in event.get("choices") or ():
        if choice.get("finish_reason") is not None:
            return True
        if chat:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):  # a tool call's first delta is a token too
                return True
        elif choice.get("text"):
            return True
    return False


def error_event(message: str, code: str) -> bytes:
    error = GatewayError(502, message, type="server_error", code=code)
    return b"data: " + error.body() + b"\n\n"


class StreamRelay:
    """An ASGI response that relays `events` (after the already read `buffered` ones)."""

    def __init__(
        self,
        flight: Flight,
        events: AsyncIterator[bytes],
        buffered: list[bytes],
        headers: dict[str, str],
        include_usage: bool,
        deadline: float,
        translator: StreamTranslator | None = None,
    ):
        self.flight, self.events, self.buffered = flight, events, buffered
        self.translator = translator  # another dialect's events for the chat chunks
        if translator is not None:
            translator.prompt_tokens = flight.prompt_tokens
            translator.cached_prompt_tokens = flight.cached_prompt_tokens
        self.headers, self.include_usage, self.deadline = headers, include_usage, deadline
        self.rename = _rename(buffered, flight.model.public_name)
        self.usage: dict | None = None
        self.usage_event: dict = {}
        self.token_events = 0  # for a cancelled stream's record: one or more tokens per event
        self.ended: list[str] = []  # why the relay stopped early: "gone" or "timeout"; or "complete"
        self.endpoint = ""  # the metrics' label, from the scope it answers

    async def __call__(self, scope, receive, send) -> None:
        self.endpoint = metrics.endpoint_of(scope)
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        headers += [(name.encode(), value.encode()) for name, value in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        # The relay runs in this task; a client that goes away, or the request's deadline,
        # cancels it (one watcher task and one timer per stream, rather than a timeout per chunk).
        task, ended = asyncio.current_task(), self.ended

        def stop(why: str) -> None:
            if not ended:  # and not once the last bytes are out: settling is not interrupted
                ended.append(why)
                task.cancel()

        async def watch() -> None:
            await wait_for_disconnect(receive)
            stop("gone")

        watcher = asyncio.ensure_future(watch())
        timer = asyncio.get_running_loop().call_at(self.deadline, stop, "timeout")
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if ended[:1] not in (["gone"], ["timeout"]):
                raise  # not ours: the server is shutting down
            task.uncancel()
        finally:
            timer.cancel()
            watcher.cancel()

    async def _relay(self, send) -> None:
        # A client gone before its first token went out got nothing: released unbilled (None).
        status, finished, error_code = None, False, ""
        events = aiter(self.events)
        try:
            try:
                for data in self.buffered:  # they end with the first token
                    finished = await self._forward(send, data)
                status = CANCELLED
                while not finished:
                    data = await anext(events, None)
                    if data is None:
                        raise UpstreamError("the replica ended the stream without finishing it")
                    finished = await self._forward(send, data)
            except asyncio.CancelledError:
                if self.ended != ["timeout"]:
                    raise  # the client went away: settled below by `status`
                raise TimeoutError from None
            status = COMPLETED
            await _drain(events)
        except (UpstreamError, TimeoutError, ValueError) as exc:
            # After the first token the client has part of an answer: the stream ends with an
            # error event, and the request is recorded as failed (not charged). What broke is the
            # operator's to read in the log; the client learns that the replica failed, and the
            # request id to quote.
            status = FAILED
            if isinstance(exc, TimeoutError):
                message, error_code = "The request took too long and was stopped.", "timeout"
            else:
                logger.warning(
                    "request %s: replica %s failed mid-stream: %s", self.flight.request_id, self.flight.replica_id, exc
                )
                message = (
                    f"The model's replica failed while answering; the answer is incomplete (request id "
                    f"{self.flight.request_id})."
                )
                error_code = "replica_failed"
            event = (
                error_event(message, error_code)
                if self.translator is None
                else self.translator.failed(message, error_code)
            )
            await send({"type": "http.response.body", "body": event, "more_body": False})
        finally:
            await events.aclose()  # closes the upstream connection unless the stream completed
            if not self.flight.settled:
                await self.flight.end(status, self.usage, completion_tokens=self.token_events, error_code=error_code)
            # A stream's status line said 200 at its start; what became of it is `status`.
            metrics.request_finished(
                model=self.flight.model.public_name,
                endpoint=self.endpoint,
                outcome=status or metrics.CANCELLED,
                status=200,
                started=self.flight.started,
                first_token_at=self.flight.first_token_at,
            )

    async def _forward(self, send, data: bytes) -> bool:
        """Send one event on to the client; True once the request is complete."""
        if data == DONE:
            # Freed before the client can send its next request: the release is on its way to
            # Redis before these last bytes are even written.
            self.flight.release_soon()
            self.ended.append("complete")
            if self.translator is not None:
                usage = None if self.usage is None else {**self.usage, "cost": float(self.flight.cost)}
                body = self.translator.finish(usage)
                await self.translator.completed()  # kept before the client can ask for it
            else:
                body = b""
                if self.include_usage and self.usage is not None:
                    self.usage_event["usage"] = {**self.usage, "cost": float(self.flight.cost)}
                    body = b"data: " + json.dumps(self.usage_event).encode() + b"\n\n"
                body += b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": False})
            await self.flight.settle(COMPLETED, self.usage, completion_tokens=self.token_events)
            return True
        if data.startswith(b'{"error"'):
            raise UpstreamError(f"its error event {data[:500]!r}")
        if not data.startswith(b"{"):  # every chunk is a JSON object: this is not one of the replica's
            raise UpstreamError(f"an event that is not a chunk: {data[:200]!r}")
        if b'"usage"' in data:
            event = json.loads(data)
            if event.get("usage") is not None and not event.get("choices"):
                event["model"] = self.flight.model.public_name
                self.usage, self.usage_event = event["usage"], event
                return False
        self.token_events += 1
        if self.translator is not None:
            if body := self.translator.chunk(json.loads(data)):
                await send({"type": "http.response.body", "body": body, "more_body": True})
            return False
        if self.rename is not None:
            data = data.replace(*self.rename, 1)
        await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})
        return False


def _rename(events: list[bytes], public_name: str) -> tuple[bytes, bytes] | None:
    """The replica names the model as it was loaded; clients must see the name they asked for.
    Chunks are relayed as bytes, so the name is swapped as bytes (after checking one chunk)."""
    served = json.loads(events[0]).get("model") if events and events[0] != DONE else None
    if not isinstance(served, str) or served == public_name:
        return None
    return (b'"model": ' + json.dumps(served).encode(), b'"model": ' + json.dumps(public_name).encode())


async def _drain(events: AsyncIterator[bytes]) -> None:
    """The replica's response ends just after [DONE]: read that end, so that the connection goes
    back to the pool instead of being closed (which would also cost the next request a connect)."""
    try:
        async with asyncio.timeout(1.0):
            async for _ in events:
                pass
    except (UpstreamError, TimeoutError):
        pass  # the answer is complete either way; the connection is simply not reused


async def wait_for_disconnect(receive) -> None:
    """Return once the ASGI client has gone (its next messages, if any, are not for us)."""
    while (await receive())["type"] != "http.disconnect":
        pass
