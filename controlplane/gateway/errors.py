"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with their headers."""

import json
import math

from starlette.responses import Response

from controlplane.billing.refusals import SHED_ERROR_CODE
from controlplane.integrations import unreachable_dependency


class GatewayError(Exception):
    """A request the gateway answers with an error; raised anywhere on the request path."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> bytes:
        return json.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        ).encode()

    def response(self, request_id: str, extra_headers: dict[str, str] | None = None) -> Response:
        headers = {**self.headers, **(extra_headers or {}), "x-request-id": request_id}
        return Response(self.body(), status_code=self.status, headers=headers, media_type="application/json")


def invalid_api_key(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def request_too_large(limit: int) -> GatewayError:
    # The rest of the body is never read, so the connection cannot carry another request.
    return GatewayError(
        413,
        f"The request body is larger than the limit of {limit} bytes (GATEWAY_MAX_REQUEST_BYTES).",
        code="request_too_large",
        headers={"connection": "close"},
    )


def model_not_found(name: str) -> GatewayError:
    return GatewayError(
        404, f"The model {name!r} does not exist or is not enabled.", param="model", code="model_not_found"
    )


def model_not_allowed(name: str) -> GatewayError:
    return GatewayError(
        403,
        f"This API key may not use the model {name!r}.",
        type="permission_error",
        param="model",
        code="model_not_allowed",
    )


def insufficient_quota() -> GatewayError:
    # x-should-retry tells the official SDKs not to retry: more credit will not appear by waiting.
    return GatewayError(
        429,
        "You have run out of credits: add credits to continue.",
        type="insufficient_quota",
        code="insufficient_quota",
        headers={"x-should-retry": "false"},
    )


def key_budget_exceeded(limit) -> GatewayError:
    # A 429 like insufficient_quota (what the SDKs raise as RateLimitError), with its own code so a
    # client can tell this key's limit from the tenant's credit; waiting will not help either.
    return GatewayError(
        429,
        f"This API key has reached its monthly spend limit (${limit:.2f}): raise the key's "
        "limit on the API keys page, use another key, or wait for next month.",
        type="insufficient_quota",
        code="key_budget_exceeded",
        headers={"x-should-retry": "false"},
    )


def overloaded(model: str, wait_s: float, objective_s: float) -> GatewayError:
    """A request shed at once: its predicted wait for a first token is over the deployment's
    objective. A 429 shaped like the rate limit's (the SDKs retry it after retry-after), with its
    own code; retry-after is the predicted time for the queue to drain back under the objective."""
    return GatewayError(
        429,
        f"{model!r} is overloaded: the predicted wait for a first token is {wait_s:.1f} s, over its objective "
        f"of {objective_s:.1f} s; retry after the retry-after header's seconds.",
        type="requests",
        code=SHED_ERROR_CODE,
        headers={"retry-after": str(max(1, math.ceil(wait_s - objective_s)))},
    )


def unavailable(message: str, retry_after_s: int, code: str = "model_unavailable") -> GatewayError:
    return GatewayError(
        503, message, type="service_unavailable", code=code, headers={"retry-after": str(retry_after_s)}
    )


def dependency_unavailable(exc: BaseException, retry_after_s: int) -> GatewayError | None:
    """A 503 naming the dependency when `exc` says the database or Redis cannot be reached (never
    the driver's message, which names hosts and users); None for any other error."""
    dependency = unreachable_dependency(exc)
    if dependency is None:
        return None
    what, code = {
        "database": ("the database", "database_unavailable"),
        "redis": ("Redis (rate limits and requests in flight)", "redis_unavailable"),
    }[dependency]
    return unavailable(f"The service cannot reach {what} right now; try again shortly.", retry_after_s, code=code)
