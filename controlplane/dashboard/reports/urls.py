"""URL patterns of the reports pages; included into the dashboard namespace by dashboard/urls.py."""

from django.urls import path

from controlplane.dashboard.reports import views

urlpatterns: list = [
    path("reports/", views.reports, name="reports"),
    path("reports/export.csv", views.reports_csv, name="reports_csv"),
]
