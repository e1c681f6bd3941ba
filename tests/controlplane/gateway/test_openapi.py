"""The gateway's OpenAPI document (/v1/openapi.json), and schemathesis fuzzing the running gateway
with it: valid and invalid requests for every operation, and no answer may be a 5xx or leave the
document (an undocumented status code or content type, or a body not matching its schema)."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_schema_conformance,
    status_code_conformance,
)

from tests.controlplane.gateway.conftest import make_world

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# Per operation and generation mode (valid requests, and requests breaking the schema): enough to cover every
# field's type and bounds now and then, few enough for CI on two cores (each completion runs on a tiny CPU model).
MAX_EXAMPLES = 25
# Completions are kept this short: the fuzzing is about the request, not the generation.
MAX_TOKENS = 4
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    ignored_auth,
]


@pytest.fixture
def world(gateway, replicas):
    return make_world(gateway, replicas)


def test_the_document_describes_the_api_from_the_request_models(gateway):
    response = httpx.get(f"{gateway.url}/v1/openapi.json", timeout=10)  # public: no key needed
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    document = response.json()
    assert sorted((path, method) for path, item in document["paths"].items() for method in item) == [
        ("/v1/batches", "get"),
        ("/v1/batches", "post"),
        ("/v1/batches/{batch_id}", "get"),
        ("/v1/batches/{batch_id}/cancel", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/embeddings", "post"),
        ("/v1/files", "get"),
        ("/v1/files", "post"),
        ("/v1/files/{file_id}", "delete"),
        ("/v1/files/{file_id}", "get"),
        ("/v1/files/{file_id}/content", "get"),
        ("/v1/messages", "post"),
        ("/v1/models", "get"),
        ("/v1/models/{model}", "get"),
        ("/v1/responses", "post"),
        ("/v1/responses/{response_id}", "delete"),
        ("/v1/responses/{response_id}", "get"),
        ("/v1/responses/{response_id}/cancel", "post"),
        ("/v1/responses/{response_id}/input_items", "get"),
    ]
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key of the tenant's.",
    }
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["properties"]["temperature"]["maximum"] == 2.0
    error = document["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]["application/json"]
    assert error["schema"] == {"$ref": "#/components/schemas/Error"}


OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "POST /v1/files",
    "GET /v1/files/{file_id}",
    "POST /v1/batches",
    "GET /v1/batches",
    "POST /v1/batches/{batch_id}/cancel",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "GET /v1/responses/{response_id}/input_items",
    "POST /v1/responses/{response_id}/cancel",
    "POST /v1/messages",
]
# The field that bounds a generation's length, per operation (chat's for the others).
LENGTH_FIELDS = {"POST /v1/responses": ("max_output_tokens",)}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("label", OPERATIONS)
def test_the_gateway_answers_every_generated_request_as_documented(world, gateway, label, mode):
    # The document as the running gateway serves it.
    schema = schemathesis.openapi.from_url(f"{gateway.url}/v1/openapi.json")
    [operation] = [result.ok() for result in schema.get_all_operations() if result.ok().label == label]
    headers = {"Authorization": f"Bearer {world.api_key.plaintext}"}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    def request_answered_as_documented(case):
        if isinstance(case.body, dict):
            # Aim completions at the served model (any other name is only a 404) and keep them short.
            case.body["model"] = world.model.public_name
            fields = LENGTH_FIELDS.get(label, ("max_tokens", "max_completion_tokens"))
            for field in fields:
                if isinstance(case.body.get(field), int) and not isinstance(case.body[field], bool):
                    case.body[field] = max(1, min(case.body[field], MAX_TOKENS))
            if not set(fields) & case.body.keys():
                # Completions default to 16 tokens, chats to the whole context: n=16 chats of 250
                # tokens each outlast the client's timeout on a loaded CI machine.
                case.body[fields[0]] = MAX_TOKENS
        case.call_and_validate(base_url=gateway.url, headers=headers, checks=CHECKS, timeout=60)

    request_answered_as_documented()
