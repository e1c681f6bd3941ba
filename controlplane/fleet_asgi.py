"""The ASGI entry point of the fleet server: what the GPU worker daemons call (/internal/: their
registration and heartbeats) and the health probes, and nothing else. It runs as a process of its
own on its own port (FLEET_PORT, 8001 by default), so that no tenant traffic on the public server
(parsing large bodies, relaying thousands of streams) can hold a heartbeat back until its worker is
judged lost. Daemons point --control-url at it; the port need not be reachable by tenants.

    uvicorn controlplane.fleet_asgi:application --port 8001
"""

import json
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from controlplane.fleet.views import FLEET_SERVER_SCOPE_KEY  # noqa: E402
from controlplane.routine_logs import quiet_heartbeat_access_lines  # noqa: E402

# Each worker's heartbeat is an HTTP request a second: its access line goes to DEBUG.
quiet_heartbeat_access_lines()

INTERNAL_PREFIX = "/internal/"
PROBES = ("/healthz", "/readyz")


def serves(path: str) -> bool:
    return path.startswith(INTERNAL_PREFIX) or path in PROBES


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
    elif scope["type"] == "http" and serves(scope.get("path", "")):
        await django_asgi_app({**scope, FLEET_SERVER_SCOPE_KEY: True}, receive, send)
    elif scope["type"] == "http":
        body = json.dumps(
            {
                "error": "The fleet server answers only /internal/ (the worker daemons' API) and the "
                "health probes; the dashboard and /v1 are on the public server."
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 404,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
    else:  # a WebSocket: nothing here speaks it
        await receive()
        await send({"type": "websocket.close", "code": 1000})


async def _lifespan(receive, send) -> None:
    # Nothing to start or close: Django opens its connections per request.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
