"""The /internal/ HTTP API the worker daemons call: registration, heartbeats, quality measurements'
progress. JSON in and out, fleet token required; parsing in the worker contract
(gpuworker.contract), the work in services.

The fleet server (controlplane.fleet_asgi) serves these on a port of its own. The public server
answers them too, so that daemons set up before the fleet server existed keep their workers; a
registration that arrives there is logged as a warning, since tenant traffic can delay it."""

import hmac
import json
import logging
from collections.abc import Callable
from functools import wraps

from django.conf import settings
from django.core.exceptions import ValidationError
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from controlplane.fleet.services.heartbeats import worker_heartbeat
from controlplane.fleet.services.quality import MeasurementUnknown, quality_measurement_progress
from controlplane.fleet.services.workers import WorkerUnknown, worker_register
from controlplane.integrations import unreachable_dependency
from gpuworker.contract.heartbeat import ContractError, parse_heartbeat, parse_registration
from gpuworker.contract.quality import parse_quality_progress

logger = logging.getLogger(__name__)

# Set by the fleet server (controlplane.fleet_asgi) in the ASGI scope of each request it serves.
FLEET_SERVER_SCOPE_KEY = "gpuserve.fleet_server"


def internal_endpoint(view: Callable) -> Callable:
    """POST only, `Authorization: Bearer <fleet worker token>`, a JSON object body; bad input
    answers 400 naming the fields."""

    @csrf_exempt
    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> JsonResponse:
        expected = f"Bearer {settings.FLEET_WORKER_TOKEN}".encode()
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
            return JsonResponse({"error": "Missing or wrong worker token (Authorization: Bearer ...)."}, status=401)
        if request.method != "POST":
            return JsonResponse({"error": "Use POST."}, status=405, headers={"Allow": "POST"})
        try:
            body = json.loads(request.body or b"null")
        except (ValueError, UnicodeDecodeError):
            return JsonResponse({"error": "The body must be JSON."}, status=400)
        try:
            return view(request, body, *args, **kwargs)
        except ContractError as exc:
            return JsonResponse({"error": "Invalid request.", "fields": {exc.field: [exc.message]}}, status=400)
        except ValidationError as exc:
            fields = exc.message_dict if hasattr(exc, "error_dict") else {"body": exc.messages}
            return JsonResponse({"error": "Invalid request.", "fields": fields}, status=400)
        except Exception as exc:
            # The control plane's own database or Redis gone: the daemon retries its next beat.
            if (dependency := unreachable_dependency(exc)) is None:
                raise
            return JsonResponse(
                {"error": f"The control plane cannot reach its {dependency} right now."},
                status=503,
                headers={"Retry-After": "1"},
            )

    return wrapper


@internal_endpoint
def register(request: HttpRequest, body) -> JsonResponse:
    worker = worker_register(registration=parse_registration(body), now=timezone.now())
    scope = getattr(request, "scope", None)  # None: not served over ASGI (a test's live server)
    if scope is not None and not scope.get(FLEET_SERVER_SCOPE_KEY):
        logger.warning(
            "worker %s registered through the public server, where tenant traffic can delay its "
            "heartbeats until it is judged lost: point its --control-url at the fleet server "
            "(FLEET_PORT)",
            worker.name,
        )
    return JsonResponse(
        {
            "worker_id": worker.pk,
            "queue": worker.queue_name,
            "heartbeat_interval_s": settings.FLEET_HEARTBEAT_INTERVAL_SECONDS,
            "celery": {
                "broker_url": settings.FLEET_WORKER_BROKER_URL,
                "broker_transport_options": settings.CELERY_BROKER_TRANSPORT_OPTIONS,
            },
        }
    )


@internal_endpoint
def heartbeat(request: HttpRequest, body, worker_id: int) -> JsonResponse:
    try:
        unload = worker_heartbeat(worker_id=worker_id, heartbeat=parse_heartbeat(body), now=timezone.now())
    except WorkerUnknown as exc:
        return JsonResponse({"error": str(exc)}, status=404)
    return JsonResponse({"ok": True, "unload": unload} if unload else {"ok": True})


@internal_endpoint
def quality(request: HttpRequest, body, worker_id: int, measurement_id: int) -> JsonResponse:
    progress = parse_quality_progress(body)
    try:
        measurement = quality_measurement_progress(
            worker_id=worker_id, measurement_id=measurement_id, progress=progress
        )
    except MeasurementUnknown as exc:
        return JsonResponse({"error": str(exc)}, status=404)
    return JsonResponse({"ok": True, "state": measurement.state})
