"""`GET /metrics`: the control plane's Prometheus metrics, for a scraper with the bearer token
(METRICS_TOKEN) or an admin logged in to the dashboard.

The gateway's counters and histograms are kept by each gateway process (summed over processes
when PROMETHEUS_MULTIPROC_DIR is set, see controlplane.gateway.metrics); the fleet's gauges are
read from the database at each scrape (controlplane.fleet.metrics).
"""

import hmac
import os

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from controlplane.dashboard.permissions import ADMIN_ROLES, has_role
from controlplane.fleet.metrics import FleetCollector
from controlplane.gateway import metrics as gateway_metrics


def render() -> bytes:
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)  # every gateway process's files
    else:
        registry.register(gateway_metrics.REGISTRY)
    registry.register(FleetCollector())
    return generate_latest(registry)


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    authorization = request.headers.get("Authorization", "")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        allowed = (
            scheme.lower() == "bearer"
            and bool(settings.METRICS_TOKEN)
            and hmac.compare_digest(token.strip().encode(), settings.METRICS_TOKEN.encode())
        )
        if not allowed:
            return _refused(401, "Wrong metrics token (Authorization: Bearer <METRICS_TOKEN>).")
    elif not request.user.is_authenticated:
        return _refused(401, "Log in as an admin, or send Authorization: Bearer <METRICS_TOKEN>.")
    elif not has_role(request.user, ADMIN_ROLES):
        return _refused(403, "Metrics are for admins (or a scraper with METRICS_TOKEN).")
    return HttpResponse(render(), content_type=CONTENT_TYPE_LATEST)


def _refused(status: int, message: str) -> HttpResponse:
    response = HttpResponse(message + "\n", status=status, content_type="text/plain; charset=utf-8")
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response
