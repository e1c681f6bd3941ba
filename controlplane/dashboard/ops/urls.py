"""URL patterns of the ops pages; included into the dashboard namespace by dashboard/urls.py."""

from django.urls import path

from controlplane.dashboard.ops import views

urlpatterns: list = [
    path("fleet/", views.fleet, name="fleet"),
    path("fleet/live", views.fleet_live, name="fleet_live"),
    path("fleet/deployments/<int:pk>/scale", views.deployment_scale_view, name="deployment_scale"),
    path("fleet/deployments/<int:pk>/edit", views.deployment_edit_view, name="deployment_edit"),
    path("fleet/deployments/<int:pk>/retry", views.deployment_retry_view, name="deployment_retry"),
    path("fleet/replicas/load", views.replica_load_view, name="replica_load"),
    path("fleet/replicas/<int:pk>/unload", views.replica_unload_view, name="replica_unload"),
    path("fleet/workers/<int:pk>/drain", views.worker_drain_view, name="worker_drain"),
    path("audit/", views.audit, name="audit"),
    path("catalog/", views.catalog, name="catalog"),
    path("catalog/add", views.catalog_add, name="catalog_add"),
    path("catalog/<int:pk>/edit", views.catalog_edit, name="catalog_edit"),
    path("catalog/<int:pk>/enabled", views.catalog_set_enabled, name="catalog_set_enabled"),
    path("catalog/<int:pk>/deploy", views.catalog_deploy, name="catalog_deploy"),
    path("catalog/<int:pk>/delete", views.catalog_delete, name="catalog_delete"),
    path("catalog/<int:pk>/measure-quality", views.catalog_measure_quality, name="catalog_measure_quality"),
    path("catalog/<int:pk>/row", views.catalog_row, name="catalog_row"),
    path("catalog/path-check", views.catalog_path_check, name="catalog_path_check"),
]
