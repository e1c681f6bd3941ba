"""WebSocket routes, one list for the whole project; the dashboard's consumers register here."""

from django.urls import path

from controlplane.dashboard.ops.consumers import FleetConsumer, HomeFleetConsumer
from controlplane.dashboard.tenant.consumers import PlaygroundConsumer

websocket_urlpatterns: list = [
    path("ws/playground/", PlaygroundConsumer.as_asgi()),
    path("ws/fleet/", FleetConsumer.as_asgi()),
    path("ws/home/fleet/", HomeFleetConsumer.as_asgi()),
]
