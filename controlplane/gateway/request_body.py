"""Reading a /v1 request body: bounded in bytes before anything else is done with the request.
Parsing it follows (body_parsing, by the contract's rules: the same the replica applies)."""

from collections.abc import Callable

from starlette.requests import Request
from starlette.types import Message

from controlplane.gateway.errors import GatewayError, request_too_large


def bounded(request: Request, limit: int, too_large: Callable[[], GatewayError]) -> Request:
    """`request` with its body bounded at `limit` bytes: `too_large()` is raised from its
    Content-Length before any of it is read, or, for a body sent without (chunked), as soon as the
    bytes read pass the limit, whatever reads it (a form parser too); the rest is never read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()
    size = 0

    async def receive() -> Message:
        nonlocal size
        message = await request.receive()
        size += len(message.get("body", b""))
        if size > limit:
            raise too_large()
        return message

    return Request(request.scope, receive)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it is known to exceed `limit` bytes (bounded)."""
    return await bounded(request, limit, lambda: request_too_large(limit)).body()
