"""Top-level URL map of the Django app: the dashboard pages, the admin, the worker daemons'
/internal/ API, the health probes and /metrics. The public /v1 API is not here: it is a Starlette app
(controlplane.gateway.app) that controlplane.asgi puts in front of Django for every /v1 path."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from controlplane import health, metrics

urlpatterns = [
    path("", include("controlplane.dashboard.urls")),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("internal/", include("controlplane.fleet.urls")),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics, name="metrics"),
]
