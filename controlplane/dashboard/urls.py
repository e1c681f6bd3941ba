from django.urls import path

from controlplane.dashboard import views
from controlplane.dashboard.ops.urls import urlpatterns as ops_urlpatterns
from controlplane.dashboard.reports.urls import urlpatterns as reports_urlpatterns
from controlplane.dashboard.request_log.urls import urlpatterns as request_log_urlpatterns
from controlplane.dashboard.team.urls import urlpatterns as team_urlpatterns
from controlplane.dashboard.tenant.urls import urlpatterns as tenant_urlpatterns
from controlplane.dashboard.tenants.urls import urlpatterns as tenants_urlpatterns

app_name = "dashboard"

# One namespace, "dashboard"; each area keeps its own patterns (ops/, tenant/, reports/, tenants/, team/,
# request_log/).
urlpatterns = [
    path("", views.home, name="home"),
    *ops_urlpatterns,
    *tenant_urlpatterns,
    *reports_urlpatterns,
    *tenants_urlpatterns,
    *team_urlpatterns,
    *request_log_urlpatterns,
]
