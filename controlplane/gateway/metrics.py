"""The gateway's Prometheus metrics: every /v1 request it answered (by model, endpoint, outcome and
HTTP status), how long it took, its time to first token, and the credits it charged. /metrics serves
them (controlplane.metrics).

The gateway runs in several processes (uvicorn --workers N), each counting its own requests. With
PROMETHEUS_MULTIPROC_DIR set before the process starts, prometheus-client keeps each process's
values in a file there and /metrics sums the files of every process, whichever one answers the
scrape; docker-compose sets it for the web service (a tmpfs, empty at each start). Without it
(`make run` runs one web process) the values live in this process's memory, in REGISTRY.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

# Seconds; from a cached key refused in a millisecond to a long generation on a busy CPU replica.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# What happened to a request: completed and cancelled ones are billed, failed and rejected ones are not.
COMPLETED, CANCELLED, FAILED, REJECTED = "completed", "cancelled", "failed", "rejected"
# The gateway's answer to a client that left before it (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499

REGISTRY = CollectorRegistry()
REQUESTS = Counter(
    "gpuserve_gateway_requests",
    "Requests to /v1, by model, endpoint (its route), outcome and HTTP status.",
    ["model", "endpoint", "outcome", "status"],
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "gpuserve_gateway_request_duration_seconds",
    "Time from a request's arrival at the gateway to its answer's last byte.",
    ["model"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "gpuserve_gateway_time_to_first_token_seconds",
    "Time from a streamed request's arrival at the gateway to its first token going out.",
    ["model"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
CREDITS_CHARGED = Counter(
    "gpuserve_credits_charged",
    "Credits charged for requests the gateway settled, in the ledger's currency.",
    ["model"],
    registry=REGISTRY,
)


def outcome_of_status(status: int) -> str:
    """A whole answer's outcome from its status: a streamed one says its own (see request_finished)."""
    if status == CLIENT_CLOSED_REQUEST:
        return CANCELLED
    if status >= 500:
        return FAILED
    return COMPLETED if status < 400 else REJECTED


def endpoint_of(scope) -> str:
    """A request's endpoint label: the path of the route it matched ("/v1/files/{file_id}"), so
    that ids stay out of the labels; "" for none."""
    route = scope.get("route")
    return getattr(route, "path", "") if route is not None else ""


def request_finished(
    *, model: str, endpoint: str, outcome: str, status: int, started: float, first_token_at: float | None = None
) -> None:
    """One answered request; `model` is "" when the request named no model it may use, `endpoint`
    is endpoint_of its scope, `started` and `first_token_at` are time.monotonic() readings."""
    REQUESTS.labels(model, endpoint, outcome, str(status)).inc()
    REQUEST_DURATION.labels(model).observe(time.monotonic() - started)
    if first_token_at is not None:
        TIME_TO_FIRST_TOKEN.labels(model).observe(first_token_at - started)


def credits_charged(*, model: str, amount) -> None:
    if amount:
        CREDITS_CHARGED.labels(model).inc(float(amount))
