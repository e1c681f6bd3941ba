"""A /v1 request body parsed and checked into what the request path needs of it (`CheckedBody`).

Runs on the event loop for small bodies and in a worker process for large ones (body_parsing), so
it imports nothing that needs Django: a worker process imports this module and the contract only.
The result is small, whatever the body's size: the body itself stays with the gateway, which
forwards the bytes it read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from controlplane.gateway.image_headers import data_url_image_size
from controlplane.gateway.replica_choice import affinity_key
from gpuworker.contract.openai_api import (
    ChatCompletionRequest,
    EmbeddingRequest,
    ProtocolError,
    check_token_ids_fit,
    data_url_bytes,
    parse_json_body,
    parse_request,
)


@dataclass(frozen=True)
class BodyError:
    """A ProtocolError as data (its own pickling would lose the param and code)."""

    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400


@dataclass(frozen=True)
class ModelLimits:
    """What a model's requests may hold: its context in tokens, and the body bytes that follow
    from it (model_request_bytes)."""

    context_length: int
    max_request_bytes: int


def model_request_bytes(
    *, context_length: int, cap: int, bytes_per_token: int, allowance: int, image_bytes: int = 0
) -> int:
    """The largest body a model of this context takes: room for its context's text (or token ids)
    at bytes_per_token each, plus an allowance for the request's structure (messages, tools) and,
    for a vision model, its images (image_bytes: their most, sent as base64), never above the
    operator's cap."""
    return min(cap, allowance + context_length * bytes_per_token + -(-image_bytes * 4 // 3))


@dataclass(frozen=True)
class CheckedBody:
    """What the request path needs of a body. `model` is the field as sent (the gateway checks it
    against its routing table before `error`, so an unknown model is named first); `error` is set
    when the body is not a valid request, and `json_error` when it is not even a JSON object
    (nothing else is known then)."""

    model: Any = None
    error: BodyError | None = None
    json_error: bool = False
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    affinity_key: str = ""
    # A stream's body as sent to the replica, which must report usage whatever the client asked;
    # None: the body is forwarded as it came.
    upstream_body: bytes | None = None
    # A chat request's image parts: each one's place (as errors name it) and, for a data: URL, its
    # size in bytes from the base64's length (None for an http(s) URL, which only the replica fetches).
    image_params: tuple[str, ...] = ()
    image_sizes: tuple[int | None, ...] = ()
    # Each image part's detail ("auto", "low" or "high"), and the characters of all their URLs: the
    # body's other bytes are its text (replica_choice.prompt_tokens_estimate).
    image_details: tuple[str, ...] = ()
    image_url_chars: int = 0
    # Each image part's (width, height) from its data: URL's header (image_headers), None where
    # unknown before the replica fetches or decodes it.
    image_dimensions: tuple[tuple[int, int] | None, ...] = ()


def check_body(
    raw: bytes, schema: type[BaseModel], affinity_chars: int, model_limits: dict[str, ModelLimits]
) -> CheckedBody:
    """`raw` parsed by `schema`'s rules (the replica's): a body larger than its model takes, or a
    token-id prompt longer than its model's context (`model_limits`, by public name), is refused
    by its length before it is validated."""
    try:
        body = parse_json_body(raw)
    except ProtocolError as exc:
        return CheckedBody(error=BodyError(exc.message, exc.param, exc.code), json_error=True)
    model = body.get("model")
    limits = model_limits.get(model) if isinstance(model, str) else None
    if limits is not None and len(raw) > limits.max_request_bytes:
        message = (
            f"The request body ({len(raw)} bytes) is larger than {model!r} takes: {limits.max_request_bytes} "
            f"bytes, for its context of {limits.context_length} tokens."
        )
        return CheckedBody(model=model, error=BodyError(message, code="request_too_large", status=413))
    try:
        if limits is not None:
            check_token_ids_fit(schema, body, limits.context_length)
        parsed = parse_request(schema, body)
    except ProtocolError as exc:
        return CheckedBody(model=model, error=BodyError(exc.message, exc.param, exc.code))
    upstream_body, include_usage = None, False
    images = parsed.images() if isinstance(parsed, ChatCompletionRequest) else []
    if parsed.stream:
        upstream_body = json.dumps({**body, "stream_options": {"include_usage": True}}).encode()
        include_usage = parsed.include_usage
    # Encoders keep no prefix cache: their requests only spread by load.
    key = "" if schema is EmbeddingRequest else affinity_key(body, schema is ChatCompletionRequest, affinity_chars)
    return CheckedBody(
        model=model,
        stream=parsed.stream,
        include_usage=include_usage,
        n=parsed.n,
        affinity_key=key,
        upstream_body=upstream_body,
        image_params=tuple(image.param for image in images),
        image_sizes=tuple(data_url_bytes(image.url) for image in images),
        image_details=tuple(image.detail for image in images),
        image_url_chars=sum(len(image.url) for image in images),
        image_dimensions=tuple(data_url_image_size(image.url) for image in images),
    )
