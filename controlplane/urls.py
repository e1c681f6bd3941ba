"""Top-level URL map: the dashboard pages, the admin, the public /v1 API, the worker daemons'
/internal/ API and the health probe."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from controlplane import health

urlpatterns = [
    path("", include("controlplane.dashboard.urls")),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("v1/", include("controlplane.gateway.urls")),
    path("internal/", include("controlplane.fleet.urls")),
    path("healthz", health.healthz, name="healthz"),
]
