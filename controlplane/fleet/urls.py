"""Routes under /internal/: what worker daemons call (not for browsers or tenants)."""

from django.urls import path

from controlplane.fleet import views

app_name = "fleet_internal"

urlpatterns = [
    path("workers/register", views.register, name="register"),
    path("workers/<int:worker_id>/heartbeat", views.heartbeat, name="heartbeat"),
    path("workers/<int:worker_id>/quality/<int:measurement_id>", views.quality, name="quality"),
]
