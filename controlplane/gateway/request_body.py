"""Reading a /v1 request body: bounded in bytes before anything else is done with the request.
Parsing it follows (body_parsing, by the contract's rules: the same the replica applies)."""

from starlette.requests import Request

from controlplane.gateway.errors import request_too_large


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it is known to exceed `limit` bytes: from its Content-Length before
    reading any of it, or while reading one sent without (chunked), whose rest is never read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise request_too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise request_too_large(limit)
        parts.append(chunk)
    return b"".join(parts)
