"""URL patterns of the request log; included into the dashboard namespace by dashboard/urls.py."""

from django.urls import path

from controlplane.dashboard.request_log import views

urlpatterns: list = [
    path("requests/", views.requests_log, name="requests"),
    path("requests/export.csv", views.requests_csv, name="requests_csv"),
]
