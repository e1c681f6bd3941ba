"""A batch input file's lines checked up front, every one, by the rules the gateway applies to the
same request sent alone (the contract's request schemas, and the model's image rules): one bad
line fails the whole batch before anything is sent or charged."""

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from gpuworker.contract.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ImageRules,
    ProtocolError,
    data_url_bytes,
    parse_request,
)

# The endpoints a batch may name, with the request schema each line's body must satisfy; the
# Responses API's schema is the gateway's own (its dialect), which passes it to `check_lines`.
BATCH_ENDPOINTS = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": None,
}
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_CUSTOM_ID_CHARS = 512
MAX_ERRORS = 100  # reported; the count of bad lines goes on past it


@dataclass
class CheckedLines:
    """How many requests a file holds and their model, or the errors that fail the batch. The
    bodies are not kept: a file of 50,000 lines is read again to record them (`requests_of`)."""

    count: int = 0
    errors: list[dict] = field(default_factory=list)
    model: str = ""


def check_lines(
    raw_lines: Iterable[bytes],
    *,
    endpoint: str,
    schema=None,
    image_rules_for: Callable[[str], ImageRules | None] | None = None,
) -> CheckedLines:
    """`schema`: the request schema, where BATCH_ENDPOINTS leaves it to the caller.
    `image_rules_for`: the image rules of the batch's model by name (asked once; None: a model
    the catalog does not know, whose lines fail when sent)."""
    schema = schema or BATCH_ENDPOINTS[endpoint]
    if schema is None:
        raise ValueError(f"endpoint: {endpoint}'s request schema must be given")
    checked = CheckedLines()
    seen: set[str] = set()
    rules: ImageRules | None = None
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            custom_id, body, parsed = _check_line(raw, schema, endpoint, seen)
            if not checked.model:
                checked.model = body["model"]
                rules = image_rules_for(checked.model) if image_rules_for is not None else None
            elif body["model"] != checked.model:
                raise ProtocolError(
                    f"body.model: every line of a batch must name the same model ({checked.model!r}); "
                    f"this one names {body['model']!r}.",
                    param="body.model",
                )
            if rules is not None:
                _check_images(parsed, rules)
        except ProtocolError as exc:
            if len(checked.errors) < MAX_ERRORS:
                checked.errors.append(
                    {"code": exc.code or "invalid_request", "message": exc.message, "param": exc.param, "line": number}
                )
            continue
        seen.add(custom_id)
        checked.count += 1
    if not checked.count and not checked.errors:
        checked.errors.append({"code": "empty_file", "message": "The input file has no requests.", "param": None})
    return checked


def _check_images(parsed, rules: ImageRules) -> None:
    """A chat line's images by its model's rules, as the gateway checks a request sent alone."""
    images = parsed.images() if isinstance(parsed, ChatCompletionRequest) else []
    try:
        rules.check([image.param for image in images], [data_url_bytes(image.url) for image in images])
    except ProtocolError as exc:
        raise ProtocolError(f"body.{exc.message}", param=f"body.{exc.param}", code=exc.code) from None


def requests_of(raw_lines: Iterable[bytes]) -> Iterator[tuple[int, str, dict]]:
    """(line number, custom_id, body) of each request of a file `check_lines` found valid."""
    for number, raw in enumerate(raw_lines, start=1):
        if raw.strip():
            line = json.loads(raw)
            yield number, line["custom_id"], line["body"]


def _check_line(raw: bytes, schema, endpoint: str, seen: set[str]) -> tuple[str, dict, object]:
    """(custom_id, body, the body parsed by `schema`), or ProtocolError naming the field."""
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("This line is not valid JSON.", code="invalid_json") from None
    if not isinstance(line, dict):
        raise ProtocolError("Each line must be a JSON object.", code="invalid_json")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise ProtocolError(f"custom_id: give a string of 1 to {MAX_CUSTOM_ID_CHARS} characters.", param="custom_id")
    if custom_id in seen:
        raise ProtocolError(
            f"custom_id: {custom_id!r} is used by an earlier line.", param="custom_id", code="duplicate_custom_id"
        )
    if line.get("method") != "POST":
        raise ProtocolError('method: must be "POST".', param="method")
    if line.get("url") != endpoint:
        raise ProtocolError(f"url: must be the batch's endpoint, {endpoint}.", param="url", code="mismatched_url")
    body = line.get("body")
    if not isinstance(body, dict):
        raise ProtocolError("body: must be a JSON object (the request).", param="body")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ProtocolError("body.model: give the name of the model to use.", param="body.model")
    if body.get("stream"):
        raise ProtocolError("body.stream: batch requests cannot stream.", param="body.stream")
    try:
        parsed = parse_request(schema, body)
    except ProtocolError as exc:
        raise ProtocolError(exc.message, param=f"body.{exc.param}" if exc.param else "body", code=exc.code) from None
    return custom_id, body, parsed
