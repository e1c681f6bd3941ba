"""The /v1 API's OpenAPI document (served at /v1/openapi.json), generated from the request models
that the gateway and the replicas check (`gpuworker.contract.openai_api`), so it cannot drift from
what is accepted. tests/controlplane/gateway/test_openapi.py fuzzes the running gateway with it.
"""

import functools

from pydantic.json_schema import models_json_schema

from controlplane.gateway import batch_openapi
from controlplane.gateway.dialects.anthropic_messages import MessagesRequest
from controlplane.gateway.dialects.responses import ResponsesRequest
from gpuworker.contract.openai_api import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

_REF = "#/components/schemas/{model}"
JSON, EVENT_STREAM = "application/json", "text/event-stream"

# What the gateway answers besides 200, each in OpenAI's error shape. 5xx are listed because they
# happen (no replica ready, a replica failing) but must never come from a request's content.
_ERRORS = {
    "400": "The body is not valid JSON, or a field is wrong (`param` names it).",
    "401": "No API key, or an invalid, revoked or expired one.",
    "403": "This API key may not use the model.",
    "404": "No such model (or endpoint).",
    "409": "A request with this Idempotency-Key is still in flight.",
    "413": "The request body is larger than the gateway accepts.",
    "429": "A rate or concurrency limit was reached (see the retry-after header), the credit ran out, or the "
    "model is overloaded (`overloaded`: the predicted wait for a first token is over its TTFT objective; "
    "retry after the retry-after header's seconds).",
    "500": "An error of the server's own.",
    "502": "The replica failed the request.",
    "503": "No replica can take the request now: none can be started for the model (`model_unavailable`), "
    "none became ready within the cold-start wait (`cold_start_timeout`) or too many requests wait for "
    "one (`cold_start_queue_full`); or a dependency is down. See the retry-after header.",
    "504": "The request took longer than the gateway allows.",
}

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}


def _completion_schema(object_name: str) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": object_name},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object", "required": ["index"]}},
            "usage": _USAGE,
        },
    }


# One server-sent event: its data is a JSON chunk, an error object, or [DONE].
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}

_MODEL_CARD = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
    },
}


_EMBEDDING_LIST = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "model": {"type": "string"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer", "minimum": 0},
                    # float: the vector; base64: little-endian float32 bytes
                    "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
                },
            },
        },
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
            },
        },
    },
}


def _ref(name: str) -> dict:
    return {"$ref": _REF.format(model=name)}


def _responses(ok: dict) -> dict:
    errors = {
        status: {"description": text, "content": {JSON: {"schema": _ref("Error")}}} for status, text in _ERRORS.items()
    }
    return {"200": ok, **errors}


# Sent with a completion (streamed or not) that waited for a replica to start, and with the 503
# that ends a wait that ran out.
_COLD_START_HEADER = {
    "x-gpuserve-cold-start": {
        "description": "The request found no ready replica and waited this many seconds for one to start "
        "(a cold start, at most GATEWAY_COLD_START_WAIT_SECONDS). Absent when it did not wait.",
        "schema": {"type": "string", "pattern": r"^[0-9]+\.[0-9]$"},
    }
}


def _completion_operation(summary: str, request: str, response: str) -> dict:
    ok = {
        "description": "The completion; with `stream: true`, server-sent events of chunks ending `data: [DONE]`.",
        "headers": _COLD_START_HEADER,
        "content": {JSON: {"schema": _ref(response)}, EVENT_STREAM: {"schema": _SSE_EVENT}},
    }
    return {
        "post": {
            "summary": summary,
            "parameters": [
                {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"}}
            ],
            "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
            "responses": _responses(ok),
        }
    }


# The Responses API's objects (what its answers and its store hold).
_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete", "queued", "in_progress", "failed", "cancelled"]},
        "model": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"]}},
        "previous_response_id": {"type": ["string", "null"]},
    },
}
_RESPONSE_DELETED = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"id": {"type": "string"}, "object": {"const": "response.deleted"}, "deleted": {"const": True}},
}
_INPUT_ITEM_LIST = {
    "type": "object",
    "required": ["object", "data", "has_more"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {"type": "object", "required": ["type", "id"]}},
        "has_more": {"type": "boolean"},
    },
}
# Anthropic's message and error shapes (/v1/messages answers in them).
_MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
    "properties": {
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object", "required": ["type"]}},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
    },
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}


def _dialect_paths() -> dict:
    """The Responses API's and the Messages API's operations."""
    streamed = "; with `stream: true`, server-sent events (named by their `type`)."

    def ok(description: str, schema: str, stream: bool = False) -> dict:
        content = {JSON: {"schema": _ref(schema)}, **({EVENT_STREAM: {"schema": _SSE_EVENT}} if stream else {})}
        return {"description": description, "content": content}

    def stored(summary: str, schema: str, description: str, **extra) -> dict:
        return {
            "summary": summary,
            "parameters": [_RESPONSE_ID],
            "responses": _responses(ok(description, schema)),
            **extra,
        }

    anthropic_errors = {
        status: {"description": text, "content": {JSON: {"schema": _ref("AnthropicError")}}}
        for status, text in _ERRORS.items()
        if status != "409"
    }
    return {
        "/v1/responses": {
            "post": {
                "summary": "Create a response (OpenAI's Responses API)",
                "requestBody": {"required": True, "content": {JSON: {"schema": _ref("ResponsesRequest")}}},
                "responses": _responses(ok("The response" + streamed, "Response", stream=True)),
            }
        },
        "/v1/responses/{response_id}": {
            "get": stored("A stored response", "Response", "The response."),
            "delete": stored("Delete a stored response", "ResponseDeleted", "Deleted."),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": stored(
                "A stored response's input items",
                "InputItemList",
                "The items, newest first unless `order=asc`.",
            )
            | {
                "parameters": [
                    _RESPONSE_ID,
                    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer"}},
                    {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
                    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
                ]
            },
        },
        "/v1/responses/{response_id}/cancel": {
            "post": stored(
                "Cancel a background response",
                "Response",
                "The response, cancelled unless it had finished (a 400 for one not made in the background).",
            )
        },
        "/v1/messages": {
            "post": {
                "summary": "Create a message (Anthropic's Messages API)",
                "security": [{"bearer": []}, {"x-api-key": []}],
                "parameters": [
                    {"name": "anthropic-version", "in": "header", "required": False, "schema": {"type": "string"}}
                ],
                "requestBody": {"required": True, "content": {JSON: {"schema": _ref("MessagesRequest")}}},
                "responses": {"200": ok("The message" + streamed, "Message", stream=True), **anthropic_errors},
            }
        },
    }


@functools.cache
def openapi_document() -> dict:
    _, definitions = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (CompletionRequest, "validation"),
            (EmbeddingRequest, "validation"),
            (ResponsesRequest, "validation"),
            (MessagesRequest, "validation"),
        ],
        ref_template=_REF,
    )
    schemas = {
        **definitions["$defs"],
        "Error": _ERROR_SCHEMA,
        "Model": _MODEL_CARD,
        "ChatCompletion": _completion_schema("chat.completion"),
        "Completion": _completion_schema("text_completion"),
        "EmbeddingList": _EMBEDDING_LIST,
        "Response": _RESPONSE,
        "ResponseDeleted": _RESPONSE_DELETED,
        "InputItemList": _INPUT_ITEM_LIST,
        "Message": _MESSAGE,
        "AnthropicError": _ANTHROPIC_ERROR,
        **batch_openapi.SCHEMAS,
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
        },
    }
    model_parameter = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpuserve /v1",
            "version": "1",
            "description": (
                "The OpenAI-compatible API: chat and text completions, embeddings, the Responses API, and the "
                "models this key may use; and Anthropic's Messages API."
            ),
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "An API key of the tenant's."},
                "x-api-key": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "x-api-key",
                    "description": "An API key of the tenant's, as Anthropic's clients send it (/v1/messages).",
                },
            },
        },
        "paths": {
            "/v1/chat/completions": _completion_operation(
                "Create a chat completion", "ChatCompletionRequest", "ChatCompletion"
            ),
            "/v1/completions": _completion_operation("Create a text completion", "CompletionRequest", "Completion"),
            "/v1/embeddings": {
                "post": {
                    "summary": "Create embeddings (models of kind Embedding)",
                    "parameters": [
                        {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"}}
                    ],
                    "requestBody": {"required": True, "content": {JSON: {"schema": _ref("EmbeddingRequest")}}},
                    "responses": _responses(
                        {
                            "description": "One embedding per input, in order.",
                            "headers": _COLD_START_HEADER,
                            "content": {JSON: {"schema": _ref("EmbeddingList")}},
                        }
                    ),
                }
            },
            "/v1/models": {
                "get": {
                    "summary": "The models this key may use",
                    "responses": _responses(
                        {"description": "The models.", "content": {JSON: {"schema": _ref("ModelList")}}}
                    ),
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One model",
                    "parameters": [model_parameter],
                    "responses": _responses(
                        {"description": "The model.", "content": {JSON: {"schema": _ref("Model")}}}
                    ),
                }
            },
            **_dialect_paths(),
            **batch_openapi.paths(_responses),
        },
    }
