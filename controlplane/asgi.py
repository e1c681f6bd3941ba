"""The ASGI entry point: the gateway's lean app for /v1, Django for the rest of HTTP, Channels for
WebSockets (uvicorn serves it)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Django must be set up before anything imports models (the routing below does, through consumers).
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import SuspiciousFileOperation  # noqa: E402
from django.http import Http404  # noqa: E402

from controlplane.gateway.app import process_app  # noqa: E402
from controlplane.routine_logs import quiet_heartbeat_access_lines  # noqa: E402
from controlplane.routing import websocket_urlpatterns  # noqa: E402


class StaticFilesHandler(ASGIStaticFilesHandler):
    """Django's /static/ handler, where a path leaving the static folders (/static/../x) is a 404:
    Django raises SuspiciousFileOperation for it here, outside the middleware that would answer
    it, so it was a 500."""

    def serve(self, request):
        try:
            return super().serve(request)
        except SuspiciousFileOperation as exc:
            raise Http404("no such static file") from exc


# Each worker's heartbeat is an HTTP request a second: its access line goes to DEBUG.
quiet_heartbeat_access_lines()

http_app = StaticFilesHandler(django_asgi_app) if settings.SERVE_STATIC else django_asgi_app
gateway_app = process_app()

django_and_channels = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)


async def application(scope, receive, send):
    # /v1 bypasses Django's middleware stack: the API's hot path pays only for what it uses.
    # Lifespan events go to the gateway, the one part with resources to close at shutdown.
    path = scope.get("path", "")
    if scope["type"] == "lifespan" or (scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/"))):
        return await gateway_app(scope, receive, send)
    return await django_and_channels(scope, receive, send)
